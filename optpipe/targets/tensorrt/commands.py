"""The build command written beside the ONNX (polygraphy convert, and the trtexec equivalent), for a
machine with TensorRT, and the calibration inputs it reads."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable, NamedTuple

from optpipe.core.artifact import MODEL_FILE
from optpipe.targets.base import TargetJob
from optpipe.targets.tensorrt.plan import BuildPlan
from optpipe.targets.tensorrt.probe import TrtFeatures

PLAN_FILE = "model.plan"
SCRIPT_FILE = "build_engine.sh"
CALIBRATION_INPUTS = "calibration_inputs.json"


def build_script(job: TargetJob, plan: BuildPlan, features: TrtFeatures) -> str:
    polygraphy = polygraphy_command(plan)
    trtexec = trtexec_command(plan)
    lines = [
        "#!/usr/bin/env bash",
        f"# Builds the TensorRT engine for stage '{job.stage.name}' of recipe '{job.settings.recipe_name}' "
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


class ToolSyntax(NamedTuple):
    """One tool's spelling of the same build: its command, then an option per setting of the plan."""

    command: str
    shape_option: str  # per profile bound: min, opt, max
    shape_separator: str  # between inputs
    shape: Callable[[str, list[int]], str]  # one input's dims
    workspace: str
    optimization_level: str
    timing_cache: str


SYNTAX = {
    "polygraphy": ToolSyntax(
        f"polygraphy convert {MODEL_FILE} --convert-to trt -o {PLAN_FILE}",
        "--trt-{}-shapes ", " ", lambda name, dims: shlex.quote(f"{name}:[{','.join(map(str, dims))}]"),
        "--pool-limit workspace:{}M", "--builder-optimization-level {}",
        '--load-timing-cache "$TIMING_CACHE" --save-timing-cache "$TIMING_CACHE"',
    ),
    "trtexec": ToolSyntax(
        f"trtexec --onnx={MODEL_FILE} --saveEngine={PLAN_FILE}",
        "--{}Shapes=", ",", lambda name, dims: f"{name}:{'x'.join(map(str, dims))}",
        "--memPoolSize=workspace:{}M", "--builderOptimizationLevel={}",
        '--timingCacheFile="$TIMING_CACHE"',
    ),
}


def polygraphy_command(plan: BuildPlan) -> list[str]:
    """`polygraphy convert` arguments, grouped one option per line."""
    return build_command(plan, "polygraphy")


def trtexec_command(plan: BuildPlan) -> list[str]:
    return build_command(plan, "trtexec")


def build_command(plan: BuildPlan, tool: str) -> list[str]:
    """The plan as `tool`'s command line, one option per entry: the two tools differ only in spelling."""
    syntax = SYNTAX[tool]
    parts = [syntax.command, *_shape_options(plan, syntax), *_precision_options(plan, style=tool)]
    if plan.workspace_mb:
        parts.append(syntax.workspace.format(plan.workspace_mb))
    if plan.builder_optimization_level is not None:
        parts.append(syntax.optimization_level.format(plan.builder_optimization_level))
    parts.append(syntax.timing_cache)
    return parts


def _shape_options(plan: BuildPlan, syntax: ToolSyntax) -> list[str]:
    """The optimization profile (min/opt/max per input) as the tool's options; none for a static model."""
    if not plan.profile:
        return []
    return [syntax.shape_option.format(bound) + syntax.shape_separator.join(syntax.shape(name, dims[index]) for name, dims in plan.profile.items())
            for index, bound in enumerate(("min", "opt", "max"))]


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

    samples = job.settings.calibration_set()
    batch = job.settings.evaluate.accuracy_batch if job.settings.shapes.batch_dim() else len(samples)
    save_json([dict(b) for b in samples.batches(batch)], str(path))
