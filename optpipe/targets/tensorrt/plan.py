"""What to build: refuse fused (com.microsoft) stages, the optimization profile from the recipe's dims,
the precision from the graph (strongly typed) or from builder flags, 2:4 sparsity."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from optpipe.core.errors import TargetError
from optpipe.targets.base import TargetJob, TensorRTParams
from optpipe.targets.model_facts import info_says_2to4, io_specs, microsoft_ops, precision_of, sparse_2to4_layers
from optpipe.targets.tensorrt.probe import TrtFeatures


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
    parent = job.settings.parents.get(job.stage.name)
    while parent is not None:
        view = job.stage_folder(parent)
        if view is not None and not microsoft_ops(view.graph):
            return parent
        parent = job.settings.parents.get(parent)
    return None


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
    if job.settings.calibration_set is None:
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
    shapes = job.settings.shapes
    specs = {spec.name: spec for spec in shapes.inputs}
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
        profile[tensor.name] = tuple(list(shapes.shape_at(spec, which)) for which in ("min", "opt", "max"))  # type: ignore[assignment]
    return profile
