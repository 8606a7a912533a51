"""Triton model repository: `<repo>/<model>/config.pbtxt` and `<repo>/<model>/1/model.onnx` (+ its
external data, platform onnxruntime_onnx) or `1/model.plan` (tensorrt_plan).

Inputs and outputs come from the ONNX graph (dtype, dims with -1 for dynamic); the batch dim
becomes `max_batch_size` with dynamic batching; the instance group runs where the stage was
measured (CPU, or GPU where the CUDA provider measured it). The ONNX Runtime settings that
were measured (threads, sequential execution) go into the backend's parameters.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Optional

from optpipe.core.errors import TargetError
from optpipe.targets import tensorrt
from optpipe.targets.base import StageView, TargetJob, TargetResult, TritonParams, copy_model, hash_files, relative
from optpipe.targets.model_facts import TensorSpec, io_specs, precision_of
from optpipe.targets.pbtxt import tensor_text as _tensor_text

CONFIG_FILE = "config.pbtxt"
VERSION = "1"
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
#: Platforms served by a named backend (config `backend:` rather than `platform:`).
BACKENDS = {"openvino": "openvino"}
#: The model.py of `backend: python` (copied as is into `1/model.py`).
PYTHON_MODEL_SOURCE = "triton_python_model.py"
# numpy dtype name (as model_facts reports it) -> Triton DataType
TRITON_TYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
    "object": "TYPE_STRING",
}


def write_repository(job: TargetJob) -> TargetResult:
    params: TritonParams = job.params  # type: ignore[assignment]
    name = model_name(params.model_name, job.settings.recipe_name, job.stage.name)
    folder = job.out_dir / name
    version_dir = folder / VERSION
    engine: Optional[TargetResult] = None
    if params.platform == "tensorrt":
        engine = engine_for(job)
        if not engine.ok:
            return job.result(engine.status, engine.reason, details={"model": name, "platform": PLATFORMS["tensorrt"]})
    if version_dir.exists():
        shutil.rmtree(version_dir)  # a stale model.onnx beside a new model.plan would confuse a reader
    version_dir.mkdir(parents=True)
    ir = None
    if engine is not None:
        shutil.copyfile(job.root / engine.path / tensorrt.PLAN_FILE, version_dir / tensorrt.PLAN_FILE)
    elif params.platform == "openvino":
        ir = openvino_model(job, version_dir)
    else:
        copy_model(job.stage, version_dir)
    config = model_config(job, params, name, ir)
    if params.backend == "python":
        config = python_backend(config, job, params, ir)
        shutil.copyfile(Path(__file__).with_name(PYTHON_MODEL_SOURCE), version_dir / "model.py")
    (folder / CONFIG_FILE).write_text(render_config(config))
    ensemble = {}
    if params.text_ensemble:
        from optpipe.targets.triton_ensemble import write_text_ensemble

        ensemble = {"text_ensemble": write_text_ensemble(job, params, config)}
    files, digest = hash_files(folder)
    source = engine or job.stage.result
    if ir and ir["converted"]:
        source = None  # the stage's numbers are ONNX Runtime's, not this IR's: its accuracy was measured here, its latency by the openvino target
    return job.result(
        "ok",
        path=relative(folder, job.root),
        precision=engine.precision if engine else (ir["precision"] if ir else precision_of(job.stage.graph)),
        provider=(engine.provider if engine else ("openvino-cpu" if ir else (source.headline.provider if source and source.headline else None))),
        accuracy=source.accuracy if source else (ir.get("accuracy") if ir else None),
        latency=source.latency if source else [],
        files=files,
        hash=digest,
        details={"model": name, "platform": config.get("platform") or config["backend"], "max_batch_size": config["max_batch_size"],
                 **({"unbatched": f"{why}: served unbatched (max_batch_size 0)"}
                    if (batch := job.settings.shapes.batch_dim()) and (why := unbatched_output(job, batch)) else {}),
                 "instance_kind": config["instance_group"][0]["kind"], **(served_precision(ir) if ir and params.backend == "native" else {}),
                 **({"runtime": config["parameters"]["runtime"]} if params.backend == "python" else {}), **ensemble},
    )


def engine_for(job: TargetJob) -> TargetResult:
    """The TensorRT engine for this stage, with the recipe's `tensorrt` target params if it has one;
    built and measured once per run (a `tensorrt` target that ran first already did)."""
    spec = next((t for t in job.settings.targets if t.kind == "tensorrt"), None)
    params = tensorrt.TensorRTParams.model_validate(spec.params if spec else {})
    key = tensorrt.engine_result_key(job.stage.name, params)
    if key not in job.extras.setdefault("engines", {}):
        sub = TargetJob(
            settings=job.settings, spec=job.spec.model_copy(update={"kind": "tensorrt", "params": params.model_dump()}),
            params=params, stage=job.stage, out_dir=engine_folder(job) / job.stage.name,
            root=job.root, cache_dir=job.cache_dir, providers=job.providers, stage_folder=job.stage_folder,
            measurer=job.measurer, stages_defaulted=job.stages_defaulted, extras=job.extras,
        )
        tensorrt.build_target(sub)
    return job.extras["engines"][key]


def engine_folder(job: TargetJob) -> Path:
    """Where engines for this repository are built: beside it in a run, never inside it
    (Triton would take any folder in the repository for a model)."""
    return job.extras.get("engine_dir") or job.out_dir.parent / "tensorrt"


def model_name(template: str, recipe: str, stage: str) -> str:
    """The model's folder name: Triton addresses models by it, so keep it to safe characters."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", template.format(recipe=recipe, stage=stage))


def openvino_model(job: TargetJob, version_dir: Path) -> dict[str, Any]:
    """`1/model.xml` + `model.bin` for Triton's openvino backend: the stage's IR, or its ONNX converted."""
    from optpipe.targets import openvino

    settings, converted = openvino.place_ir(job, version_dir)
    (version_dir / "openvino.json").unlink()  # Triton reads the config.pbtxt parameters, not this file
    settings["io"] = openvino.ir_io_specs(version_dir, settings.get("output_names"))
    settings["converted"] = converted
    if converted and job.measurer is not None:
        # The stage's numbers are ONNX Runtime's: the IR's accuracy is measured here (a conversion can change it).
        settings["accuracy"] = openvino.measure_accuracy(job, version_dir, settings.get("output_names"))
        try:
            openvino.check_conversion(job, version_dir, settings["accuracy"])
        except TargetError:
            shutil.rmtree(version_dir.parent)  # no half model (a config-less folder) left in the repository
            raise
    return settings


def model_config(job: TargetJob, params: TritonParams, name: str, ir: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    inputs, outputs = ir["io"] if ir else io_specs(job.stage.graph)
    batch_max = batching_limit(job, params, inputs, outputs)
    strip = 1 if batch_max > 0 else 0
    kind = instance_kind(job, params)
    platform = {"backend": BACKENDS[params.platform]} if params.platform in BACKENDS else {"platform": PLATFORMS[params.platform]}
    config: dict[str, Any] = {
        "name": name,
        **platform,
        "max_batch_size": batch_max,
        "input": [_tensor(t, strip) for t in inputs],
        "output": [_tensor(t, strip) for t in outputs],
        "instance_group": [{"count": params.instances, "kind": kind}],
        "parameters": {},
    }
    if batch_max > 0 and params.dynamic_batching:
        preferred = [b for b in job.settings.evaluate.batch_sizes if 1 < b <= batch_max]
        config["dynamic_batching"] = {"preferred_batch_size": preferred, "max_queue_delay_microseconds": params.max_queue_delay_us}
    if params.platform == "onnxruntime":
        # The ONNX Runtime backend's names for the session settings the stage was measured with.
        config["parameters"] = {
            "intra_op_thread_count": str(job.settings.evaluate.threads),
            "inter_op_thread_count": "1",
            "execution_mode": "0",  # sequential
        }
    if params.platform == "openvino":
        # The openvino backend's names for the compile settings the stage was measured with. HINT_BF16
        # takes only YES (any other value fails the model's load, openvino_backend's ParseParameterHelper),
        # and no parameter pins f32: an f32 IR is served at the CPU plugin's default (served_precision).
        config["parameters"] = {
            "INFERENCE_NUM_THREADS": str(job.settings.evaluate.threads),
            "NUM_STREAMS": "1",
            "PERFORMANCE_HINT": "LATENCY",
            **({"HINT_BF16": "YES"} if ir and ir["hint"] == "bf16" else {}),
        }
    return config


def python_backend(config: dict[str, Any], job: TargetJob, params: TritonParams, ir: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The same model as a python-backend model: model.py runs the artifact in the platform's runtime with
    the measured settings, which it reads from these parameters (the backend's own names mean nothing to it)."""
    served = {key: value for key, value in config.items() if key != "platform"}
    served["backend"] = "python"
    served["instance_group"] = [{"count": params.instances, "kind": "KIND_CPU"}]  # model.py runs on the CPU
    served["parameters"] = {
        "runtime": "openvino" if ir else "onnxruntime",
        "model_file": "model.xml" if ir else "model.onnx",
        "threads": str(job.settings.evaluate.threads),
        **({"hint": ir["hint"]} if ir else {}),
    }
    ranges = dim_ranges(job, served)
    if ranges:
        served["parameters"]["dim_ranges"] = ranges
    return served


def dim_ranges(job: TargetJob, config: dict[str, Any]) -> str:
    """The recipe's ranges for the named non-batch dims, for model.py to refuse a request outside what was
    measured (Triton's dims say only -1): `input,axis,min,max,dim` entries joined by ';'."""
    names = {t["name"] for t in config["input"]}
    first = 1 if config["max_batch_size"] > 0 else 0  # the batch dim: Triton's own max_batch_size check
    entries = []
    for spec in job.settings.shapes.inputs:
        if spec.name not in names or re.search(r'[;,"\\]', spec.name):
            continue
        for axis, dim in enumerate(spec.shape):
            if axis >= first and isinstance(dim, str) and dim in job.settings.shapes.dims:
                limit = job.settings.shapes.dims[dim]
                entries.append(f"{spec.name},{axis},{limit.min},{limit.max},{dim}")
    return ";".join(entries)


def served_precision(ir: dict[str, Any]) -> dict[str, Any]:
    """What Triton's openvino backend will run float ops at, on this CPU: the stage's bf16 hint, or the
    plugin's default (bf16 on CPUs with BF16), with a warning when that is not what was measured."""
    from optpipe.evaluation import openvino_runtime as ovr

    served = "bf16" if ir["hint"] == "bf16" else ovr.default_inference_precision()
    facts: dict[str, Any] = {"served_inference_precision": served}
    if served != ir["hint"]:
        facts["warning"] = (f"Triton's openvino backend has no setting that pins {ir['hint']}: on this CPU it runs float ops at "
                            f"{served} (its default), not the {ir['hint']} this stage was measured at")
    return facts


def batching_limit(job: TargetJob, params: TritonParams, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> int:
    """max_batch_size: the batch dim's max when every input and output leads with a dynamic dim, else 0."""
    batch = job.settings.shapes.batch_dim()
    if batch is None:
        return 0
    leads_dynamic = all(t.dims and not isinstance(t.dims[0], int) for t in inputs + outputs)
    why = unbatched_output(job, batch)
    if why and params.max_batch_size:  # asked for by the recipe: a wrong answer per request, not a setting to drop
        raise TargetError(f"targets (triton): max_batch_size {params.max_batch_size} cannot be served: {why}; "
                          "set max_batch_size: 0 (or return one row per sample from the model)")
    if not leads_dynamic or why:
        return 0
    limit = job.settings.shapes.dims[batch].max
    if params.max_batch_size is None:
        return limit
    if params.max_batch_size > limit:
        raise TargetError(
            f"targets (triton): max_batch_size {params.max_batch_size} exceeds the batch dim '{batch}' max {limit} "
            f"the model was measured (and TensorRT profiled) for; lower it or raise dims.{batch}.max"
        )
    return params.max_batch_size


def unbatched_output(job: TargetJob, batch: str) -> Optional[str]:
    """Why Triton must not batch requests together (None: it may): an output that does not lead with the batch dim.
    Its first dim may still be dynamic (a length that depends on the data: the scores past a threshold) and Triton
    would split it between the requests it joined as if it were one row per sample, silently. The dims' names come
    from the nearest ONNX graph: an IR's dynamic dims have none. Or a model whose rows lead with the batch but mix its
    samples (unbatched attention over the first dim), found by the export: each request would change the others'."""
    lineage = _lineage(job)
    view = next((v for v in lineage if v.model_path.is_file()), None)
    if view is None:
        return None
    for spec in io_specs(view.graph)[1]:
        if not spec.dims or spec.dims[0] != batch:
            lead = f"leads with {spec.dims[0]!r}" if spec.dims else "is 0-d"
            return f"output '{spec.name}' {lead}, not the batch dim '{batch}'"
    mixed = lineage[-1].info.get("samples_mixed")  # the export's (the served stage's first ancestor)
    if mixed:  # the export found that eager computes across the batch: joined requests would change each other's answers
        return (f"output '{mixed['output']}' mixes the samples of a batch" if mixed.get("output") else
                "no output is one row per sample") + " (the export's check of one sample alone against its row in a batch)"
    return None


def _lineage(job: TargetJob) -> list[StageView]:
    """The served stage, then its parent, up to the stage it descends from first (the export)."""
    views = [job.stage]
    while (parent := job.settings.parents.get(views[-1].name)) and (view := job.stage_folder(parent)) is not None:
        views.append(view)
    return views


def instance_kind(job: TargetJob, params: TritonParams) -> str:
    if params.platform == "openvino":
        if params.device == "gpu":
            raise TargetError("targets (triton): optpipe measures OpenVINO on the CPU; set `device: cpu` or another platform")
        return "KIND_CPU"
    if params.platform == "tensorrt":
        if params.device == "cpu":
            raise TargetError("targets (triton): a tensorrt_plan model runs on GPUs only; set `device: gpu` or `platform: onnxruntime`")
        return "KIND_GPU"
    if params.device == "auto":
        return "KIND_GPU" if job.providers and job.providers[0] == "CUDAExecutionProvider" else "KIND_CPU"
    return f"KIND_{params.device.upper()}"


def _tensor(tensor: TensorSpec, strip: int) -> dict[str, Any]:
    if tensor.dtype not in TRITON_TYPES:
        raise TargetError(f"targets (triton): tensor '{tensor.name}' has type {tensor.dtype}, which Triton has no type for")
    dims = [d if isinstance(d, int) else -1 for d in tensor.dims[strip:]]
    spec = {"name": tensor.name, "data_type": TRITON_TYPES[tensor.dtype], "dims": dims or [1]}
    if not dims:  # Triton wants at least one dim: a scalar per sample is [1] reshaped to []
        spec["reshape"] = []
    return spec


# --- protobuf text format --------------------------------------------------------------------
# Written by hand rather than through tritonclient's ModelConfig message: that would make
# grpcio and tritonclient runtime dependencies for ~30 lines of text. The tests parse every
# written file with tritonclient.grpc.model_config_pb2.ModelConfig.


def render_config(config: dict[str, Any]) -> str:
    runs_on = f'backend: "{config["backend"]}"' if "backend" in config else f'platform: "{config["platform"]}"'
    lines = [
        f'name: "{config["name"]}"',
        runs_on,
        f'max_batch_size: {config["max_batch_size"]}',
    ]
    for section in ("input", "output"):
        lines.append(f"{section} [")
        lines.append(",\n".join(_tensor_text(t) for t in config[section]))
        lines.append("]")
    lines.append("instance_group [")
    lines.append(",\n".join(f"  {{\n    count: {g['count']}\n    kind: {g['kind']}\n  }}" for g in config["instance_group"]))
    lines.append("]")
    batching = config.get("dynamic_batching")
    if batching is not None:
        lines.append("dynamic_batching {")
        if batching["preferred_batch_size"]:
            lines.append(f"  preferred_batch_size: [ {', '.join(map(str, batching['preferred_batch_size']))} ]")
        lines.append(f"  max_queue_delay_microseconds: {batching['max_queue_delay_microseconds']}")
        lines.append("}")
    for key, value in config["parameters"].items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"
