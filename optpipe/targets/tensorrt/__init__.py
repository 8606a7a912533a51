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

The package, one job per module: probe (what TensorRT offers here), plan (what to build),
commands (the script written beside the ONNX), build (the engine, on a GPU machine),
evaluate (its accuracy and latency). This module runs them for one target job.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from optpipe.core.artifact import copy_file
from optpipe.core.errors import TargetError
from optpipe.targets.base import TargetJob, TargetResult, TensorRTParams, copy_model, hash_files, relative
from optpipe.targets.tensorrt.build import build_engine
from optpipe.targets.tensorrt.commands import CALIBRATION_INPUTS, PLAN_FILE, SCRIPT_FILE, build_script, polygraphy_command, trtexec_command, write_calibration_inputs
from optpipe.targets.tensorrt.evaluate import evaluate_engine
from optpipe.targets.tensorrt.plan import BuildPlan, plan_build, standard_op_refusal
from optpipe.targets.tensorrt.probe import ASSUMED_FEATURES, TrtFeatures, probe_features, tensorrt_missing

__all__ = [
    "ASSUMED_FEATURES", "CALIBRATION_INPUTS", "PLAN_FILE", "SCRIPT_FILE", "BuildPlan", "TrtFeatures", "build_target",
    "engine_result_key", "plan_build", "polygraphy_command", "standard_op_refusal", "tensorrt_missing", "trtexec_command",
]
log = logging.getLogger("optpipe.targets.tensorrt")


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
