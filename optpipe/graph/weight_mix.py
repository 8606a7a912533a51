"""The weights of a graph by precision: elements and bytes, with packed 4-bit weights counted as
what they stand for (optpipe.graph.coverage's weight columns)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto

from optpipe.graph.edit import node_attribute

INT8_DTYPES = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4, TensorProto.INT32}
FLOAT_NAMES = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.DOUBLE: "fp64"}
#: Initializers smaller than this are scales, zero points and shapes, not weights.
MIN_WEIGHT_ELEMENTS = 16


def weight_mix(graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]) -> tuple[dict[str, int], dict[str, int]]:
    """Weight elements and bytes per precision; small tensors (scales, zero points, shapes) do not count
    as elements. A MatMulNBits weight is packed (two 4-bit values a byte, in uint8 blocks): its elements
    are the K x N it stands for, in int4 / int8, and its bytes the packed ones plus its scales and zero points."""
    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    packed = _packed_weights(graph)
    for tensor in [*graph.initializer, *constants.values()]:
        size = int(np.prod(tensor.dims, dtype=np.int64))
        if tensor.name in packed:
            precision, elements = packed[tensor.name]
            counts[precision] += elements
            sizes[precision] += size * _itemsize(tensor.data_type)
            continue
        if size < MIN_WEIGHT_ELEMENTS:
            continue
        if tensor.data_type in INT8_DTYPES - {TensorProto.INT32}:
            precision = "int4" if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4) else "int8"
            counts[precision] += size
            sizes[precision] += size // 2 if precision == "int4" else size
        elif tensor.data_type == TensorProto.INT32:
            continue  # quantized biases: part of an int8 op, too small to matter
        elif tensor.data_type in FLOAT_NAMES:
            counts[FLOAT_NAMES[tensor.data_type]] += size
            sizes[FLOAT_NAMES[tensor.data_type]] += size * _itemsize(tensor.data_type)
    return counts, sizes


def nbits_precision(node: onnx.NodeProto) -> str:
    return f"int{node_attribute(node, 'bits', 4)}"


def _packed_weights(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """MatMulNBits inputs 1-3 (packed weight, scales, zero points) -> (its precision, the elements
    it stands for: K x N for the weight, 0 for the rest)."""
    found: dict[str, tuple[str, int]] = {}
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        precision = nbits_precision(node)
        elements = int(node_attribute(node, "K", 0)) * int(node_attribute(node, "N", 0))
        for index, name in enumerate(node.input[1:4]):
            if name:
                found[name] = (precision, elements if index == 0 else 0)
    return found


def _itemsize(data_type: int) -> int:
    try:
        return int(onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize)
    except (KeyError, TypeError, ValueError):  # int4 and other sub-byte types numpy has no dtype for
        return 1


def file_uses_bfloat16(path) -> bool:
    """uses_bfloat16 of the graph in the ONNX file at `path` (its weights not read); False where it cannot be read."""
    try:
        return uses_bfloat16(onnx.load(str(path), load_external_data=False).graph)
    except Exception:  # noqa: BLE001 - callers only word a failure's cause with it
        return False


def uses_bfloat16(graph: onnx.GraphProto) -> bool:
    """The graph computes in bfloat16: bfloat16 weights, inputs or outputs, or a Cast to it (an autocast region).
    ONNX Runtime's CPU provider has kernels for few bfloat16 ops: where it cannot load such a graph, that is why."""
    values = [*graph.input, *graph.output]
    return (any(t.data_type == TensorProto.BFLOAT16 for t in graph.initializer)
            or any(v.type.tensor_type.elem_type == TensorProto.BFLOAT16 for v in values)
            or any(node.op_type == "Cast" and node_attribute(node, "to", None) == TensorProto.BFLOAT16 for node in graph.node))
