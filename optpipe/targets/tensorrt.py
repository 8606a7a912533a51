"""TensorRT engine (model.plan) from a stage's standard-op ONNX, through Polygraphy's loaders.

- Profiles: one optimization profile from the recipe's dims (min/opt/max per dynamic input).
- Precision: from the graph. TensorRT >= 10 builds graphs that carry their precision (Q/DQ
  nodes, FP16 tensors) as strongly typed networks; TensorRT 11 removed the FP16/INT8 builder
  flags and the implicit INT8 calibrators, so those are used only where they still exist and
  only when asked for (`precision: fp16|int8` on an FP32 graph).
- A timing cache lives in the optpipe cache; engines are cached there too, keyed by the
  model, the build settings, the TensorRT version and the GPU.
- 2:4 sparse weights: enabled where the weights hold the pattern (or the prune stage says so).

Where TensorRT or a CUDA device is missing, the target is skipped (with the reason) and the exact
build command (polygraphy convert, and the trtexec equivalent) is written beside the ONNX.
"""
from __future__ import annotations

import logging
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from optpipe.evaluation.accuracy import quiet_polygraphy
from optpipe.artifact import MODEL_FILE, copy_file, sha256_json
from optpipe.errors import TargetError
from optpipe.runtime import cuda_available
from optpipe.targets.base import TargetJob, TargetResult, TensorRTParams, copy_model, hash_files, relative
from optpipe.targets.model_facts import info_says_2to4, io_specs, microsoft_ops, precision_of, sparse_2to4_layers

PLAN_FILE = "model.plan"
SCRIPT_FILE = "build_engine.sh"
CALIBRATION_INPUTS = "calibration_inputs.json"
BUILD_FORMAT = 1
log = logging.getLogger("optpipe.targets.tensorrt")


@dataclass(frozen=True)
class TrtFeatures:
    """What the TensorRT at hand offers, probed by attribute (versions removed things at different times)."""

    version: str
    strongly_typed: bool
    fp16_flag: bool
    int8_flag: bool
    calibrator: bool


# What the build command is written for when TensorRT is not here: TensorRT 10, the current
# major on PyPI (strongly typed networks; builder flags and calibrators deprecated, still present).
ASSUMED_FEATURES = TrtFeatures(version="10.x", strongly_typed=True, fp16_flag=True, int8_flag=True, calibrator=True)


@dataclass
class BuildPlan:
    """Every choice that shapes the engine: the cache key and the command are both made from it."""

    profile: dict[str, tuple[list[int], list[int], list[int]]]
    graph_precision: str
    precision: str
    strongly_typed: bool
    fp16: bool = False
    int8: bool = False
    calibrate: bool = False
    sparse_weights: bool = False
    tf32: bool = False
    workspace_mb: Optional[int] = None
    builder_optimization_level: Optional[int] = None
    notes: list[str] = field(default_factory=list)


def build_target(job: TargetJob) -> TargetResult:
    """Build (or explain how to build) the engine; the result is also kept for a Triton target of the run."""
    try:
        result = _build_target(job)
    except TargetError as exc:
        result = job.result("failed", str(exc))
    job.extras.setdefault("engines", {})[engine_result_key(job.stage.name, job.params)] = result
    return result


def engine_result_key(stage: str, params) -> str:
    return f"{stage}:{params.model_dump_json()}"


def _build_target(job: TargetJob) -> TargetResult:
    params: TensorRTParams = job.params  # type: ignore[assignment]
    refusal = standard_op_refusal(job)
    if refusal:
        if job.stages_defaulted:
            return job.result("skipped", refusal)
        raise TargetError(refusal)
    missing = tensorrt_missing()
    features = ASSUMED_FEATURES if missing else probe_features()
    plan = plan_build(job, params, features)
    folder = job.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PLAN_FILE).unlink(missing_ok=True)
    copy_model(job.stage, folder)
    if plan.calibrate:
        write_calibration_inputs(job, folder / CALIBRATION_INPUTS)
    (folder / SCRIPT_FILE).write_text(build_script(job, plan, features))
    (folder / SCRIPT_FILE).chmod(0o755)
    details: dict[str, Any] = {"build": asdict(plan), "tensorrt": features.version, "command": SCRIPT_FILE}
    if missing:
        files, digest = hash_files(folder)
        where = relative(folder / SCRIPT_FILE, job.root)
        return job.result(
            "skipped", f"{missing}; the build command is in {where}",
            path=relative(folder, job.root), precision=plan.precision, files=files, hash=digest, details=details,
        )
    plan_path = build_engine(job, plan, features)
    copy_file(plan_path, folder / PLAN_FILE)
    accuracy, latency, provider = None, [], f"TensorRT {features.version}"
    if params.evaluate and job.measurer is not None:
        accuracy, latency = evaluate_engine(folder / PLAN_FILE, job, provider)
    files, digest = hash_files(folder)
    return job.result(
        "ok", path=relative(folder, job.root), precision=plan.precision, provider=provider,
        accuracy=accuracy, latency=latency, files=files, hash=digest, details=details,
    )


# --- what to build -------------------------------------------------------------------------


def standard_op_refusal(job: TargetJob) -> Optional[str]:
    """Why TensorRT cannot take this stage (fused com.microsoft ops), naming the stage to use instead."""
    fused = microsoft_ops(job.stage.graph)
    if not fused:
        return None
    parent = standard_op_ancestor(job)
    instead = f"build it from the standard-op stage '{parent}' (targets.stages: [{parent}])" if parent else (
        "build it from a stage before the fusion"
    )
    return (
        f"stage '{job.stage.name}' has com.microsoft ops ({', '.join(fused)}) that only ONNX Runtime runs, "
        f"not TensorRT; {instead}"
    )


def standard_op_ancestor(job: TargetJob) -> Optional[str]:
    """The nearest ancestor stage whose graph has no com.microsoft ops."""
    parent = job.recipe.stages[job.stage.name].after if job.stage.name in job.recipe.stages else None
    while parent is not None:
        view = job.stage_folder(parent)
        if view is not None and not microsoft_ops(view.graph):
            return parent
        parent = job.recipe.stages[parent].after
    return None


def tensorrt_missing() -> Optional[str]:
    """None where an engine can be built here; else the one-line reason."""
    try:
        import tensorrt  # noqa: F401
    except Exception:  # ImportError, or a broken install failing to load its libraries
        return "TensorRT is not installed here (`import tensorrt` fails)"
    if not cuda_available():
        return "no CUDA device here"
    return None


def probe_features() -> TrtFeatures:
    import tensorrt as trt

    return TrtFeatures(
        version=trt.__version__,
        strongly_typed=hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"),
        fp16_flag=hasattr(trt.BuilderFlag, "FP16"),
        int8_flag=hasattr(trt.BuilderFlag, "INT8"),
        calibrator=hasattr(trt, "IInt8EntropyCalibrator2"),
    )


def plan_build(job: TargetJob, params: TensorRTParams, features: TrtFeatures) -> BuildPlan:
    graph_precision = precision_of(job.stage.graph)
    plan = BuildPlan(
        profile=profile_shapes(job),
        graph_precision=graph_precision,
        precision=graph_precision,
        strongly_typed=False,
        tf32=params.tf32,
        workspace_mb=params.workspace_mb,
        builder_optimization_level=params.builder_optimization_level,
    )
    choose_precision(plan, params.precision, features, job)
    plan.sparse_weights = wants_sparse(job, params)
    return plan


def choose_precision(plan: BuildPlan, requested: str, features: TrtFeatures, job: TargetJob) -> None:
    """Strongly typed where the graph carries its precision; builder flags only where they exist and are asked for."""
    where = f"targets ({job.spec.kind}, stage '{job.stage.name}'): precision"
    if plan.graph_precision != "fp32":
        if requested not in ("auto",) and requested not in plan.graph_precision.split("+"):
            raise TargetError(
                f"{where} '{requested}' contradicts the graph, which is {plan.graph_precision}; use `precision: auto`"
            )
        if features.strongly_typed:
            plan.strongly_typed = True
            plan.notes.append("strongly typed: precision comes from the graph's Q/DQ nodes and FP16 tensors")
        else:  # TensorRT < 9: explicit precision needs the builder flags
            plan.int8 = "int8" in plan.graph_precision
            plan.fp16 = "fp16" in plan.graph_precision or plan.int8
        return
    if requested in ("auto", "fp32"):
        # TensorRT 11 has only strongly typed networks; an FP32 graph builds the same either way.
        plan.strongly_typed = features.strongly_typed and not features.fp16_flag
        return
    if requested == "fp16":
        if not features.fp16_flag:
            raise TargetError(f"{where} fp16: TensorRT {features.version} has no FP16 builder flag; build from an fp16 stage instead")
        plan.fp16, plan.precision = True, "fp16 (builder flag)"
        plan.notes.append("FP16 builder flag: deprecated since TensorRT 10.12, removed in 11; prefer an fp16 stage")
        return
    if not (features.int8_flag and features.calibrator):
        raise TargetError(f"{where} int8: TensorRT {features.version} has no INT8 calibrator; build from an int8 (Q/DQ) stage instead")
    if job.recipe.data.calibration is None:
        raise TargetError(f"{where} int8 on an FP32 graph calibrates TensorRT: add `data: {{calibration: ...}}` to the recipe")
    plan.int8 = plan.fp16 = plan.calibrate = True
    plan.precision = "int8 (calibrated)"
    plan.notes.append("implicit INT8 calibration: deprecated since TensorRT 10.1, removed in 11; prefer an int8 (Q/DQ) stage")


def wants_sparse(job: TargetJob, params: TensorRTParams) -> bool:
    if params.sparse_weights != "auto":
        return bool(params.sparse_weights)
    if info_says_2to4(job.stage.info):
        return True
    import onnx

    counts = sparse_2to4_layers(onnx.load(str(job.stage.model_path)))
    return counts["sparse_2to4"] > 0


def profile_shapes(job: TargetJob) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """min/opt/max shape per graph input, from the recipe's dims."""
    recipe = job.recipe
    specs = {spec.name: spec for spec in recipe.inputs}
    inputs, _ = io_specs(job.stage.graph)
    profile = {}
    for tensor in inputs:
        spec = specs.get(tensor.name)
        if spec is None:
            if not all(isinstance(d, int) for d in tensor.dims):
                raise TargetError(
                    f"targets: stage '{job.stage.name}' has a dynamic input '{tensor.name}' the recipe's `inputs` do not describe; add it there"
                )
            fixed = [int(d) for d in tensor.dims]  # type: ignore[arg-type]
            profile[tensor.name] = (fixed, fixed, fixed)
            continue
        profile[tensor.name] = tuple(list(recipe.shape_at(spec, which)) for which in ("min", "opt", "max"))  # type: ignore[assignment]
    return profile


# --- the command written beside the ONNX ---------------------------------------------------


def build_script(job: TargetJob, plan: BuildPlan, features: TrtFeatures) -> str:
    polygraphy = polygraphy_command(plan)
    trtexec = trtexec_command(plan)
    lines = [
        "#!/usr/bin/env bash",
        f"# Builds the TensorRT engine for stage '{job.stage.name}' of recipe '{job.recipe.name}' "
        f"({plan.precision}) on a machine with TensorRT and a CUDA GPU.",
        f"# Written for TensorRT {features.version}; optimization profile from the recipe's dims (min/opt/max).",
        *[f"# {note}" for note in plan.notes],
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        # The timing cache optpipe's own builds use: one per TensorRT version, in the optpipe cache.
        "TRT_VERSION=$(python3 -c 'import tensorrt; print(tensorrt.__version__)')",
        'TIMING_CACHE="${OPTPIPE_CACHE:-$HOME/.cache/optpipe}/tensorrt/timing-${TRT_VERSION}.cache"',
        'mkdir -p "$(dirname "$TIMING_CACHE")"',
        " \\\n    ".join(polygraphy),
        "",
        "# The same build with trtexec:",
        "# " + " \\\n#     ".join(trtexec),
        "",
    ]
    return "\n".join(lines)


def polygraphy_command(plan: BuildPlan) -> list[str]:
    """`polygraphy convert` arguments, grouped one option per line."""
    def shapes(index: int) -> str:
        return " ".join(shlex.quote(f"{name}:[{','.join(map(str, dims[index]))}]") for name, dims in plan.profile.items())

    parts = [f"polygraphy convert {MODEL_FILE} --convert-to trt -o {PLAN_FILE}"]
    if plan.profile:
        parts += [f"--trt-min-shapes {shapes(0)}", f"--trt-opt-shapes {shapes(1)}", f"--trt-max-shapes {shapes(2)}"]
    parts += _precision_options(plan, style="polygraphy")
    if plan.workspace_mb:
        parts.append(f"--pool-limit workspace:{plan.workspace_mb}M")
    if plan.builder_optimization_level is not None:
        parts.append(f"--builder-optimization-level {plan.builder_optimization_level}")
    parts.append('--load-timing-cache "$TIMING_CACHE" --save-timing-cache "$TIMING_CACHE"')
    return parts


def trtexec_command(plan: BuildPlan) -> list[str]:
    def shapes(index: int) -> str:
        return ",".join(f"{name}:{'x'.join(map(str, dims[index]))}" for name, dims in plan.profile.items())

    parts = [f"trtexec --onnx={MODEL_FILE} --saveEngine={PLAN_FILE}"]
    if plan.profile:
        parts += [f"--minShapes={shapes(0)}", f"--optShapes={shapes(1)}", f"--maxShapes={shapes(2)}"]
    parts += _precision_options(plan, style="trtexec")
    if plan.workspace_mb:
        parts.append(f"--memPoolSize=workspace:{plan.workspace_mb}M")
    if plan.builder_optimization_level is not None:
        parts.append(f"--builderOptimizationLevel={plan.builder_optimization_level}")
    parts.append('--timingCacheFile="$TIMING_CACHE"')
    return parts


def _precision_options(plan: BuildPlan, style: str) -> list[str]:
    poly = style == "polygraphy"
    options = []
    if plan.strongly_typed:
        options.append("--strongly-typed" if poly else "--stronglyTyped")
    if plan.fp16:
        options.append("--fp16")
    if plan.int8:
        options.append("--int8")
    if plan.calibrate:
        options.append(
            f"--load-inputs {CALIBRATION_INPUTS} --calibration-cache calibration.cache" if poly
            else "--calib=calibration.cache  # the cache the polygraphy command above writes"
        )
    if plan.sparse_weights:
        options.append("--sparse-weights" if poly else "--sparsity=enable")
    if poly and plan.tf32:
        options.append("--tf32")
    if not poly and not plan.tf32 and not plan.strongly_typed:
        options.append("--noTF32")  # trtexec allows TF32 by default, Polygraphy does not
    return options


def write_calibration_inputs(job: TargetJob, path: Path) -> None:
    """The calibration batches in Polygraphy's JSON input format (read by --load-inputs)."""
    from polygraphy.json import save_json

    from optpipe.calibration.dataset import build_sample_set

    samples = build_sample_set(job.recipe.data.calibration, job.recipe, job.cache_dir)
    batch = job.recipe.evaluate.accuracy_batch if job.recipe.batch_dim() else len(samples)
    save_json([dict(b) for b in samples.batches(batch)], str(path))


# --- building and measuring on a GPU machine -----------------------------------------------


def build_engine(job: TargetJob, plan: BuildPlan, features: TrtFeatures) -> Path:
    """The engine for this plan, from the cache or built through Polygraphy's loaders."""
    import torch

    key = sha256_json({
        "format": BUILD_FORMAT,
        "model": job.stage.result.hash if job.stage.result and job.stage.result.hash else hash_files(job.stage.folder)[1],
        "plan": asdict(plan),
        "tensorrt": features.version,
        "gpu": torch.cuda.get_device_name(0),
    })
    engines = job.cache_dir / "tensorrt" / "engines"
    target = engines / f"{key}.plan"
    if target.is_file():
        return target
    engines.mkdir(parents=True, exist_ok=True)
    tmp = engines / f".{key}.tmp"
    _build_with_polygraphy(job, plan, tmp)
    tmp.replace(target)
    return target


def _build_with_polygraphy(job: TargetJob, plan: BuildPlan, dest: Path) -> None:
    import tensorrt as trt
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        EngineFromBytes,
        NetworkFromOnnxPath,
        Profile,
        SaveEngine,
    )

    quiet_polygraphy()
    timing_cache = job.cache_dir / "tensorrt" / f"timing-{trt.__version__}.cache"
    profile = Profile()
    for name, (low, opt, high) in plan.profile.items():
        profile.add(name, min=low, opt=opt, max=high)
    config_args: dict[str, Any] = {
        "profiles": [profile],
        "load_timing_cache": str(timing_cache) if timing_cache.exists() else None,
        "sparse_weights": plan.sparse_weights or None,
        "builder_optimization_level": plan.builder_optimization_level,
    }
    if plan.workspace_mb:
        config_args["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: plan.workspace_mb << 20}
    # Only set precision flags that exist: CreateConfig fails on flags TensorRT 11 removed.
    for flag in ("fp16", "int8", "tf32"):
        if getattr(plan, flag):
            config_args[flag] = True
    if plan.calibrate:
        config_args["calibrator"] = _calibrator(job, plan)
    network = NetworkFromOnnxPath(str(job.stage.model_path), strongly_typed=plan.strongly_typed or None)
    engine_bytes = EngineBytesFromNetwork(network, config=CreateConfig(**config_args), save_timing_cache=str(timing_cache))
    SaveEngine(EngineFromBytes(engine_bytes), path=str(dest))()


def _calibrator(job: TargetJob, plan: BuildPlan):
    """Polygraphy's calibrator over the cached calibration set; its cache is keyed by model and data,
    since Polygraphy reuses any non-empty cache file without checking what it was made from."""
    from polygraphy.backend.trt import Calibrator

    from optpipe.calibration.dataset import build_sample_set

    samples = build_sample_set(job.recipe.data.calibration, job.recipe, job.cache_dir)
    model_hash = job.stage.result.hash if job.stage.result else hash_files(job.stage.folder)[1]
    cache = job.cache_dir / "tensorrt" / "calibration" / f"{sha256_json({'model': model_hash, 'data': samples.key})}.cache"
    cache.parent.mkdir(parents=True, exist_ok=True)
    batch = job.recipe.evaluate.accuracy_batch if job.recipe.batch_dim() else len(samples)
    return Calibrator(list(samples.batches(batch)), cache=str(cache))


def evaluate_engine(plan_path: Path, job: TargetJob, provider: str):
    """Accuracy against the reference through Polygraphy's TrtRunner, and latency percentiles."""
    from polygraphy.backend.trt import EngineFromPath, TrtRunner
    from polygraphy.comparator import Comparator

    quiet_polygraphy()
    measurer = job.measurer
    engine = EngineFromPath(str(plan_path))
    results = Comparator.run([TrtRunner(engine, name="tensorrt")], data_loader=measurer.batches)
    iterations = results[0][1]
    outputs = {name: np.concatenate([np.asarray(it[name]) for it in iterations]) for name in iterations[0].keys()}
    accuracy = measurer.accuracy(outputs, job.recipe.tolerance_for(job.stage.name))
    with TrtRunner(engine, name="tensorrt-latency") as runner:
        latency = measurer.latency(lambda feeds: runner.infer(feeds), provider)
    return accuracy, latency

