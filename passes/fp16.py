"""fp16: cast a model to FP16 (inputs/outputs kept FP32), with an accuracy guard that keeps culprits in FP32."""
from __future__ import annotations

import shutil
from typing import Optional

import numpy as np
import onnx
from pydantic import Field

from optpipe.artifact import ModelArtifact, save_model, write_info
from optpipe.errors import PassError, first_line
from optpipe.graph.edit import name_unnamed_nodes, topologically_sorted
from optpipe.graph.stats import graph_stats
from optpipe.pass_base import Pass, PassContext, PassParams

# The converter's names for the Cast it puts after a kept (FP32) node's output.
_KEPT_OUTPUT_SUFFIX = "_cast_to_fp16"


class Fp16Params(PassParams):
    keep_io_types: bool = Field(True, description="keep FP32 model inputs and outputs (Casts inside the graph)")
    op_block_list: Optional[list[str]] = Field(
        None, description="op types left in FP32; default: onnxruntime's float16.DEFAULT_OP_BLOCK_LIST"
    )
    node_block_list: list[str] = Field(default_factory=list, description="node names always left in FP32")
    guard: bool = Field(True, description="keep nodes in FP32 until the stage's tolerance holds")
    max_kept_nodes: int = Field(32, ge=0, description="the guard keeps at most this many nodes in FP32")
    localize_samples: int = Field(4, ge=1, description="evaluation samples used to find the culprit nodes")


class Fp16Pass(Pass[Fp16Params]):
    """Cast weights and activations to FP16 (FP32 I/O); the guard keeps overflowing/lossy nodes in FP32."""

    name = "fp16"
    version = "1"
    Params = Fp16Params
    libraries = ("onnx", "onnxruntime", "onnxruntime-gpu", "onnx-ir")

    def fingerprint(self, ctx: PassContext) -> dict:
        params = self.params
        if not params.guard:
            return {}
        return {"eval_set": ctx.eval_set().key, "tolerance": ctx.tolerance.model_dump(mode="json")}

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        source = name_unnamed_nodes(model.load())
        _check_node_names(source, params.node_block_list)
        kept = [{"node": n, "op": _op_of(source, n), "reason": "listed in node_block_list"} for n in params.node_block_list]
        converted = self._convert(source, [k["node"] for k in kept])
        guard_info = None
        if params.guard:
            guard = AccuracyGuard(source, model, ctx, params)
            converted, guard_kept, guard_info = guard.run(converted, kept, self._convert)
            kept += guard_kept
        artifact = save_model(converted, ctx.workdir)
        info = {
            "keep_io_types": params.keep_io_types,
            "op_block_list": sorted(params.op_block_list) if params.op_block_list is not None else "onnxruntime default",
            "fp32_nodes": kept,
            "guard": guard_info,
            "note": "ONNX Runtime's CPU provider runs most FP16 ops as FP32 behind Casts: CPU latency of this stage "
            "is not FP16 speed, and the guard measures accuracy on an FP16-storage emulation (see optpipe/evaluation/fp16_numerics.py)",
            "graph": graph_stats(artifact.load(with_weights=False)),
        }
        return write_info(ctx.workdir, info)

    def _convert(self, source: onnx.ModelProto, node_block_list: list[str]) -> onnx.ModelProto:
        params = self.params
        return convert_to_fp16(source, params.keep_io_types, params.op_block_list, node_block_list)


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
    join_kept_regions(converted)
    return topologically_sorted(converted)


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
    used = {name for node in model.graph.node for name in node.input} | {out.name for out in model.graph.output}
    dead = [n for n in model.graph.node if n.op_type == "Cast" and not any(o in used for o in n.output)]
    for node in dead:
        model.graph.node.remove(node)


class AccuracyGuard:
    """Keep the nodes that break the tolerance in FP32, one round at a time, until it holds or the limit is hit."""

    def __init__(self, source: onnx.ModelProto, source_artifact: ModelArtifact, ctx: PassContext, params: Fp16Params):
        self.source = source
        self.ctx = ctx
        self.params = params
        self.threads = ctx.recipe.evaluate.threads
        self.scratch = ctx.workdir / "guard"
        self.scratch.mkdir(exist_ok=True)
        eval_set = ctx.eval_set()
        self.inputs = eval_set.arrays
        self.batches = list(eval_set.batches(_accuracy_batch(ctx.recipe)))
        self.localize_feeds = next(eval_set.batches(params.localize_samples))
        from optpipe.evaluation.accuracy import run_onnx

        self.reference = run_onnx(source_artifact.path, self.batches, self.threads)

    def run(self, converted, kept_by_recipe, convert):
        from optpipe.evaluation.fp16_numerics import tensor_types
        from optpipe.evaluation.error_attribution import float_activations

        types = tensor_types(self.source)
        self.activations = float_activations(self.source, types)
        accuracy = self.accuracy(converted)
        plain = _summary(accuracy)
        kept: list[dict] = []
        blocked = [k["node"] for k in kept_by_recipe]
        while not accuracy.within_tolerance and len(kept) < self.params.max_kept_nodes:
            culprits = self.culprits(converted, set(blocked))
            if not culprits:
                break
            room = self.params.max_kept_nodes - len(kept)
            culprits = culprits[:room]
            blocked += [c.node for c in culprits]
            converted = convert(self.source, blocked)
            new_accuracy = self.accuracy(converted)
            for culprit in culprits:
                kept.append({**culprit.as_dict(), "error_before": _summary(accuracy), "error_after": _summary(new_accuracy)})
            self.ctx.log.info("fp16 guard kept %s in FP32: %s", [c.node for c in culprits], _summary(new_accuracy))
            accuracy = new_accuracy
        shutil.rmtree(self.scratch, ignore_errors=True)
        info = {
            "tolerance": self.ctx.tolerance.model_dump(mode="json"),
            "samples": len(next(iter(self.inputs.values()))),
            "plain_fp16": plain,
            "final": _summary(accuracy),
            "within_tolerance": accuracy.within_tolerance,
            "kept_by_guard": len(kept),
            "limit_reached": not accuracy.within_tolerance and len(kept) >= self.params.max_kept_nodes,
        }
        if not accuracy.within_tolerance:
            self.ctx.log.warning("fp16 guard could not reach the tolerance: %s", accuracy.violations)
        return converted, kept, info

    def accuracy(self, converted: onnx.ModelProto):
        """Accuracy of the FP16 numerics (emulated, see fp16_numerics) against the pass's input model."""
        from optpipe.evaluation.accuracy import compare, run_onnx
        from optpipe.evaluation.fp16_numerics import emulate_fp16

        path = self.scratch / "emulated.onnx"
        onnx.save_model(emulate_fp16(converted), str(path), save_as_external_data=True, location="emulated.onnx.data")
        outputs = run_onnx(path, self.batches, self.threads)
        return compare(outputs, self.reference, self.inputs, self.ctx.tolerance, "pass input (FP32)", self.ctx.recipe.evaluate.top1)

    def culprits(self, converted: onnx.ModelProto, blocked: set[str]):
        """The nodes to keep in FP32 next: every node that overflows, else the one adding the most error."""
        from optpipe.evaluation.fp16_numerics import emulate_fp16
        from optpipe.evaluation.error_attribution import blame_nodes, run_with_outputs

        emulated = emulate_fp16(converted)
        produced = {out for node in emulated.graph.node for out in node.output}
        # A kept node's FP32 value is what its kept consumers read; its rounded copy is what FP16 consumers read.
        alias = {name: name + _KEPT_OUTPUT_SUFFIX if name + _KEPT_OUTPUT_SUFFIX in produced else name for name in self.activations}
        alias = {name: other for name, other in alias.items() if other in produced}
        reference = run_with_outputs(self.source, list(alias), self.localize_feeds, self.threads)
        values = run_with_outputs(emulated, list(alias.values()), self.localize_feeds, self.threads)
        candidate = {name: values[other] for name, other in alias.items()}
        blames = blame_nodes(self.source, reference, candidate, skip=blocked)
        overflowing = [b for b in blames if b.overflow]
        return overflowing or blames[:1]


def _accuracy_batch(recipe) -> int:
    if recipe.batch_dim():
        return recipe.evaluate.accuracy_batch
    first = recipe.inputs[0].shape[0] if recipe.inputs[0].shape else 1
    return first if isinstance(first, int) else 1


def _summary(accuracy) -> dict:
    return {
        "cosine": round(accuracy.worst_cosine, 6),
        "max_abs": _finite_or_inf(max(o.max_abs for o in accuracy.outputs)),
        "within_tolerance": accuracy.within_tolerance,
    }


def _finite_or_inf(value: float):
    return float(value) if np.isfinite(value) else "inf"


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _op_of(model: onnx.ModelProto, name: str) -> str:
    return next((n.op_type for n in model.graph.node if n.name == name), "?")


def _check_node_names(model: onnx.ModelProto, names: list[str]) -> None:
    known = {node.name for node in model.graph.node}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PassError(f"node_block_list names nodes the model does not have: {unknown[:5]}; use names from the input model")
