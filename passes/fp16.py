"""fp16: cast a model to FP16 (inputs/outputs kept FP32), with an accuracy guard that keeps culprits in FP32."""
from __future__ import annotations

from typing import Optional

import onnx
from pydantic import Field

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.core.errors import PassError, first_line
from optpipe.evaluation.fp16_numerics import emulate_fp16
from optpipe.evaluation.guard import MAX_EXCLUDED_ALIASES, AccuracyGuard, GuardParams
from optpipe.evaluation.guard_types import guard_criteria
from optpipe.graph.edit import name_unnamed_nodes, read_names, topologically_sorted
from optpipe.graph.stats import graph_stats
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams

# The converter's names for the Cast it puts after a kept (FP32) node's output.
_KEPT_OUTPUT_SUFFIX = "_cast_to_fp16"


class Fp16Params(PassParams, GuardParams):
    keep_io_types: bool = Field(True, description="keep FP32 model inputs and outputs (Casts inside the graph)")
    op_block_list: Optional[list[str]] = Field(
        None, description="op types left in FP32; default: onnxruntime's float16.DEFAULT_OP_BLOCK_LIST"
    )
    # Overflow culprits come several at a time (one per normalisation): a wider limit than int8's.
    max_excluded: int = Field(32, ge=0, validation_alias=MAX_EXCLUDED_ALIASES, description="guard: most nodes it keeps in FP32")


class Fp16Pass(Pass[Fp16Params]):
    """Cast weights and activations to FP16 (FP32 I/O); the guard keeps overflowing/lossy nodes in FP32."""

    name = "fp16"
    version = "3"  # 3: the guard keeps a node in float where it brings the verdict's error down (R², the task's metric)
    Params = Fp16Params
    libraries = ("onnx", "onnxruntime", "onnxruntime-gpu", "onnx-ir")
    # The guard decides which nodes stay FP32 on ORT CPU's FP16 numerics, which differ per ISA
    # (AVX-512 FP16 and Arm run half-precision kernels; AVX2 casts): a decision per CPU class.
    isa_dependent = True

    def fingerprint(self, ctx: PassContext) -> dict:
        # The guard always measures (and, when on, repairs) with the stage's tolerance. The evaluation
        # set it measures on joins the stage's key by itself (PassContext.data_used).
        return guard_criteria(ctx)

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        source = name_unnamed_nodes(model.load())
        _check_node_names(source, params.exclude)
        convert = lambda excluded: convert_to_fp16(source, params.keep_io_types, params.op_block_list, excluded)  # noqa: E731
        guard = AccuracyGuard(
            ctx, model, params, convert, numerics=emulate_fp16, numerics_label="emulated FP16 storage",
            tensor_in=_kept_or_same, graph=source,
        )
        result = guard.run(params.exclude)
        artifact = save_model(result.model, ctx.workdir)
        kept = [{"node": n, "op": _op_of(source, n), "reason": "listed in exclude"} for n in params.exclude]
        kept += [{"node": n, "op": op, "reason": step.reason} for step in result.report.steps if step.kept for n, op in zip(step.nodes, step.ops)]
        info = {
            "keep_io_types": params.keep_io_types,
            "op_block_list": sorted(params.op_block_list) if params.op_block_list is not None else "onnxruntime default",
            "fp32_nodes": kept,
            "guard": result.report.model_dump(mode="json"),
            "note": "ONNX Runtime's CPU provider runs most FP16 ops as FP32 behind Casts: CPU latency of this stage "
            "is not FP16 speed, and the guard measures accuracy on an FP16-storage emulation (see optpipe/evaluation/fp16_numerics.py)",
            "graph": graph_stats(artifact.load(with_weights=False)),
        }
        return write_info(ctx.workdir, info)


def convert_to_fp16(
    source: onnx.ModelProto, keep_io_types: bool, op_block_list: list[str] | None, node_block_list: list[str]
) -> onnx.ModelProto:
    """onnxruntime's converter (works on dynamo exports, unlike onnxconverter_common's), then two repairs."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    copy = onnx.ModelProto()
    copy.CopyFrom(source)  # the converter edits its argument in place
    try:
        converted = convert_float_to_float16(
            copy, keep_io_types=keep_io_types, op_block_list=op_block_list, node_block_list=node_block_list
        )
    except Exception as exc:  # shape inference or conversion errors on unusual graphs
        raise PassError(f"FP16 conversion failed: {first_line(exc)}; add the failing op to `op_block_list`") from None
    drop_duplicate_casts(converted)
    drop_stale_initializer_types(converted)
    join_kept_regions(converted)
    return topologically_sorted(converted)


def drop_stale_initializer_types(model: onnx.ModelProto) -> None:
    """The converter declares a weight it kept in FP32 for a node in float (a classifier's Gemm at a graph output) as FP16
    in value_info, beside the FP32 initializer: ONNX Runtime loads it, but shape inference refuses the graph ("Inferred
    elem type differs from existing elem type: (1) vs (10)"), and the guard's FP16 emulation with it (an x-vector model's
    fp16 stage failed as an internal error). An initializer's own type is the truth: such entries go."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    stale = [v for v in model.graph.value_info if v.name in types and v.type.tensor_type.elem_type not in (0, types[v.name])]
    for entry in stale:
        model.graph.value_info.remove(entry)


def drop_duplicate_casts(model: onnx.ModelProto) -> None:
    """The converter adds one `<x>_cast_to_fp32` Cast per kept consumer of `x`: two kept consumers
    give two nodes writing the same tensor (an invalid graph). Keep the first of each."""
    seen: set[tuple] = set()
    for node in list(model.graph.node):
        if node.op_type != "Cast":
            continue
        signature = (tuple(node.input), tuple(node.output), _cast_to(node))
        if signature in seen:
            model.graph.node.remove(node)
        seen.add(signature)


def join_kept_regions(model: onnx.ModelProto) -> None:
    """Let neighbouring FP32 nodes pass FP32 values directly.

    The converter puts FP32->FP16 after every kept node and FP16->FP32 before every
    kept consumer, so two kept neighbours still round (and overflow) in between:
    keeping a ReduceSum that overflows would not help its kept consumer. Each
    FP16->FP32 Cast reading such a rounded value is pointed at the FP32 original.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.op_type != "Cast" or _cast_to(node) != onnx.TensorProto.FLOAT:
            continue
        producer = producers.get(node.input[0])
        if producer is not None and producer.op_type == "Cast" and producer.input[0] == node.input[0] + _KEPT_OUTPUT_SUFFIX:
            node.input[0] = producer.input[0]
    used = read_names(model.graph)
    dead = [n for n in model.graph.node if n.op_type == "Cast" and not any(o in used for o in n.output)]
    for node in dead:
        model.graph.node.remove(node)


def _kept_or_same(name: str, produced: set[str]) -> str | None:
    """A kept node's FP32 value is what its kept consumers read; its rounded copy is what FP16 consumers read."""
    if name + _KEPT_OUTPUT_SUFFIX in produced:
        return name + _KEPT_OUTPUT_SUFFIX
    return name if name in produced else None


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _op_of(model: onnx.ModelProto, name: str) -> str:
    return next((n.op_type for n in model.graph.node if n.name == name), "?")


def _check_node_names(model: onnx.ModelProto, names: list[str]) -> None:
    known = {node.name for node in model.graph.node}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PassError(f"exclude (node_block_list) names nodes the model does not have: {unknown[:5]}; use names from the input model")
