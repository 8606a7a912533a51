"""prune: remove whole channels / FFN neurons (structured), or zero weights (magnitude, 2:4 for TensorRT)."""
from __future__ import annotations

from collections import Counter
from typing import Literal, Optional, Union

import numpy as np
import onnx
from onnx import numpy_helper
from pydantic import Field, model_validator

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.core.errors import PassError, first_line
from optpipe.graph.edit import name_unnamed_nodes
from optpipe.graph.stats import graph_stats
from optpipe.pass_infra.pass_base import Pass, PassContext

WEIGHT_OPS = ("Conv", "MatMul", "Gemm")


class PruneParams(SelfCheckParams):
    # No fine-tuning follows: outputs move by design, so the self-check records by how much
    # (info.json's self_check) and the stage evaluation judges it; set these to make it a gate.
    check_atol: Optional[float] = Field(None, ge=0, description="self-check: absolute tolerance against the input (default: record only)")
    check_rtol: Optional[float] = Field(None, ge=0, description="self-check: relative tolerance against the input (default: record only)")
    method: Literal["structured", "magnitude", "2:4"] = Field(
        "structured", description="structured: remove channels/neurons (CPU speed); magnitude: zero weights; 2:4: TensorRT sparsity"
    )
    amount: Optional[float] = Field(
        None, gt=0, lt=1, description="fraction removed: of each channel group (structured) or of each weight (magnitude)"
    )
    round_to: Union[int, Literal["auto"]] = Field(
        "auto", description="structured: kept channel counts are rounded up to a multiple of this; auto = the target's "
        "vector width (the CPU's fp32 SIMD lanes: 16 with AVX-512, 8 with AVX2; at least 16 with a TensorRT target)"
    )
    min_channels: int = Field(8, ge=1, description="structured: never keep fewer channels than this in a group")
    residual_streams: bool = Field(
        True, description="structured: also prune channel groups joined by residual Adds (faster, costs more accuracy)"
    )
    ops: list[Literal["Conv", "MatMul", "Gemm"]] = Field(
        default_factory=lambda: list(WEIGHT_OPS), description="magnitude / 2:4: which ops' weights are sparsified"
    )

    @model_validator(mode="after")
    def _amount_fits_method(self):
        if self.method == "2:4" and self.amount not in (None, 0.5):
            raise ValueError("2:4 sparsity always removes half of the weights; remove `amount`")
        if self.method != "2:4" and self.amount is None:
            raise ValueError(f"method '{self.method}' needs `amount`, the fraction to remove (e.g. 0.5)")
        return self


class PrunePass(Pass[PruneParams]):
    """Structured pruning (Conv channels through BN/ReLU/Add, FFN neurons) or magnitude / 2:4 weight sparsity."""

    name = "prune"
    version = "2"
    Params = PruneParams
    libraries = ("onnx",)

    def fingerprint(self, ctx: PassContext) -> dict:
        return {"round_to": resolved_round_to(self.params, ctx)}  # auto differs between machines

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params.model_copy(update={"round_to": resolved_round_to(self.params, ctx)})
        pruned = name_unnamed_nodes(model.load())
        before = graph_stats(pruned)
        if params.method == "structured":
            details = prune_structured(pruned, params)
        else:
            details = sparsify_weights(pruned, params)
        _check_graph(pruned)
        artifact = save_model(pruned, ctx.workdir)
        after = graph_stats(artifact.load(with_weights=False))
        info = {
            "method": params.method,
            "amount": 0.5 if params.method == "2:4" else params.amount,
            "round_to": params.round_to,
            **details,
            "parameters_before": before["parameters"],
            "parameters_after": after["parameters"],
            "graph": after,
        }
        ctx.log.info("prune %s: %s", params.method, {k: v for k, v in details.items() if not isinstance(v, list)})
        return write_info(ctx.workdir, info)


def resolved_round_to(params: PruneParams, ctx: PassContext) -> int:
    """round_to as a number: `auto` is the vector width of the recipe's targets on this machine."""
    if params.round_to != "auto":
        return int(params.round_to)
    from optpipe.hardware.simd import channel_multiple

    return channel_multiple(list(ctx.target_kinds))


def prune_structured(model: onnx.ModelProto, params: PruneParams) -> dict:
    """Remove the least important `amount` of every sound channel group; returns what was removed."""
    from optpipe.graph.channel_groups import GroupFinder, apply_pruning, channels_to_keep, constants_to_initializers

    constants_to_initializers(model)
    finder = GroupFinder(model)
    groups = finder.groups()
    plan, pruned_rows, unchanged = {}, [], []
    for group in groups:
        if not group.prunable or (not params.residual_streams and len(group.producers) > 1):
            continue
        keep = channels_to_keep(group, finder.weights, params.amount, params.round_to, params.min_channels)
        if len(keep) == group.channels:
            unchanged.append(group.root)
            continue
        plan[group.root] = (group, keep)
        pruned_rows.append(
            {
                "producers": sorted({p.node for p in group.producers}),
                "kind": group.kind,
                "channels_before": group.channels,
                "channels_after": int(len(keep)),
            }
        )
    if not plan and unchanged:
        raise PassError(
            f"structured pruning of {params.amount:.0%} removes nothing: every prunable channel group keeps all its channels "
            f"once rounded up to a multiple of {params.round_to} (round_to); raise `amount` or lower `round_to`"
        )
    if not plan:
        raise PassError(
            "structured pruning found no channel group it can prune soundly (Conv/MatMul outputs that reach only "
            "channel-wise ops and other Convs/MatMuls); use `method: magnitude` or `2:4` for this model"
        )
    apply_pruning(model, plan)
    blocked = Counter(_short_reason(g.blockers[0]) for g in groups if g.producers and g.blockers)
    removed = sum(r["channels_before"] - r["channels_after"] for r in pruned_rows)
    total = sum(r["channels_before"] for r in pruned_rows)
    return {
        "groups_pruned": len(plan),
        "groups_kept_whole": sum(1 for g in groups if g.producers and g.blockers) + len(unchanged),
        "channels_removed": removed,
        "channels_in_pruned_groups": total,
        "kept_whole_because": dict(blocked.most_common()),
        "pruned": pruned_rows,
    }


def sparsify_weights(model: onnx.ModelProto, params: PruneParams) -> dict:
    """Magnitude or 2:4 zeros in the weights of Conv/MatMul/Gemm; 2:4 is verified on every weight it touched."""
    from optpipe.graph.sparsity import is_two_four, magnitude_prune, prunable_weights, sparsity, two_four

    targets = prunable_weights(model, set(params.ops))
    by_name = {init.name: i for i, init in enumerate(model.graph.initializer)}
    layers, skipped = [], []
    zeros = total = 0
    for target in targets:
        weight = numpy_helper.to_array(model.graph.initializer[by_name[target.initializer]])
        if params.method == "2:4":
            if weight.shape[target.reduction_axis] % 4:
                skipped.append({"node": target.node, "reason": f"reduction axis has {weight.shape[target.reduction_axis]} entries, not a multiple of 4"})
                continue
            new = two_four(weight, target.reduction_axis)
            if not is_two_four(new, target.reduction_axis):
                raise PassError(f"2:4 pattern check failed on '{target.initializer}'")  # a bug, not a user error
        else:
            new = magnitude_prune(weight, params.amount)
        model.graph.initializer[by_name[target.initializer]].CopyFrom(numpy_helper.from_array(new, target.initializer))
        zeros += int((new == 0).sum())
        total += new.size
        layers.append({"node": target.node, "op": target.op, "shape": list(new.shape), "sparsity": round(sparsity(new), 4)})
    if not layers:
        raise PassError(f"no {', '.join(params.ops)} weights could be sparsified; check `ops` or use another method")
    details = {"layers": len(layers), "sparsity": round(zeros / total, 4) if total else 0.0, "sparse_layers": layers}
    if params.method == "2:4":
        details["pattern_verified"] = True
        details["skipped"] = skipped
        details["note"] = "2:4 is for TensorRT sparse kernels on GPU; on CPU zeros are not faster"
    return details


def _check_graph(model: onnx.ModelProto) -> None:
    """The pruned graph must still be a valid model whose shapes agree (strict shape inference)."""
    try:
        onnx.checker.check_model(model)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:  # checker and inference raise several types
        raise PassError(f"pruning produced an inconsistent graph ({first_line(exc)}); this is a bug, please report it") from None


def _short_reason(reason: str) -> str:
    """'read by Reshape 'node_12'' -> 'read by Reshape': counts group by op, not by node."""
    return reason.split(" '")[0]
