"""Weight sparsity on an ONNX graph: unstructured magnitude pruning and 2:4 semi-structured sparsity.

2:4 is the pattern TensorRT's sparse tensor-core kernels use (Ampere and later):
along the reduction axis (a Conv's input channels, a MatMul's inner dimension),
every group of 4 consecutive weights has at most 2 non-zeros. On a CPU neither
kind of zeros is faster (DESIGN.md: 80% unstructured was slower); only the
pattern can be checked here, and `is_two_four` is that check.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from optpipe.graph.edit import node_attribute


@dataclass(frozen=True)
class PrunableWeight:
    initializer: str
    node: str
    op: str
    reduction_axis: int  # the axis summed over: where 2:4 groups of four run


def prunable_weights(model: onnx.ModelProto, ops: set[str]) -> list[PrunableWeight]:
    """Weights of Conv (ungrouped), MatMul and Gemm nodes that are initializers, each listed once."""
    initializers = {init.name: init for init in model.graph.initializer}
    found: dict[str, PrunableWeight] = {}
    for node in model.graph.node:
        if node.op_type not in ops or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        name = node.input[1]
        init = initializers.get(name)
        if init is None or len(init.dims) < 2 or name in found:
            continue
        if node.op_type == "Conv":
            if node_attribute(node, "group", 1) != 1:
                continue  # a grouped conv's input axis holds a slice of the channels, not a reduction TensorRT sparsifies
            axis = 1
        elif node.op_type == "Gemm":
            axis = 1 if node_attribute(node, "transB", 0) else 0
        else:
            if len(init.dims) != 2:
                continue
            axis = 0
        found[name] = PrunableWeight(name, node.name, node.op_type, axis)
    return list(found.values())


def magnitude_prune(weight: np.ndarray, amount: float) -> np.ndarray:
    """Zero the `amount` fraction of entries with the smallest |w| (ties broken by position)."""
    flat = np.abs(weight).ravel()
    count = int(round(amount * flat.size))
    pruned = weight.copy().ravel()
    if count:
        pruned[np.argsort(flat, kind="stable")[:count]] = 0
    return pruned.reshape(weight.shape)


def two_four(weight: np.ndarray, axis: int) -> np.ndarray:
    """Keep the 2 largest |w| of every 4 consecutive weights along `axis`; the axis must divide by 4."""
    moved = np.moveaxis(weight, axis, -1)
    groups = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 4, 4)
    smallest = np.argsort(np.abs(groups), axis=-1, kind="stable")[..., :2]
    pruned = groups.copy()
    np.put_along_axis(pruned, smallest, 0, axis=-1)
    return np.moveaxis(pruned.reshape(moved.shape), -1, axis)


def is_two_four(weight: np.ndarray, axis: int) -> bool:
    """True when every group of 4 consecutive weights along `axis` has at most 2 non-zeros."""
    if weight.shape[axis] % 4:
        return False
    moved = np.moveaxis(weight, axis, -1)
    groups = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 4, 4)
    return bool(((groups != 0).sum(axis=-1) <= 2).all())


def sparsity(weight: np.ndarray) -> float:
    return float((weight == 0).mean()) if weight.size else 0.0

