"""What a deployment target needs to know about a stage's ONNX graph, read from the graph itself.

Precision lives in the graph (FP16 tensors and casts, Q/DQ nodes): that is what TensorRT's
strongly typed networks consume and what the manifest reports. Fused `com.microsoft` ops run
in ONNX Runtime only. 2:4 sparsity is checked on the weights, not taken on trust.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from optpipe.graph.coverage import INTEGER_OPS
from optpipe.graph.weight_mix import nbits_precision

MICROSOFT_DOMAIN = "com.microsoft"
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
# Ops whose second input is a weight TensorRT's sparse kernels can use, with its reduction axis.
SPARSE_CANDIDATES = {"MatMul", "Gemm", "Conv"}

Dim = Union[int, str, None]


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: its name, element type (numpy name) and dims (str = symbolic, None = unknown)."""

    name: str
    dtype: str
    dims: tuple[Dim, ...]


def io_specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's real inputs (initializers excluded) and its outputs."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [_spec(value) for value in model.graph.input if value.name not in initializers]
    return inputs, [_spec(value) for value in model.graph.output]


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor = value.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name if tensor.elem_type else "unknown"
    if tensor.elem_type == TensorProto.BFLOAT16:
        dtype = "bfloat16"  # numpy has no bfloat16; onnx maps it to uint16
    dims: list[Dim] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        else:
            dims.append(dim.dim_param or None)
    return TensorSpec(value.name, dtype, tuple(dims))


def microsoft_ops(model: onnx.ModelProto) -> list[str]:
    """The com.microsoft (ONNX Runtime contrib) op types in the graph: TensorRT cannot parse them."""
    return sorted({node.op_type for node in _all_nodes(model) if node.domain == MICROSOFT_DOMAIN})


def precision_of(model: onnx.ModelProto) -> str:
    """The compute precision the graph itself declares: int4 / int8 (weight-only MatMulNBits in its
    weights' bits; Q/DQ; ORT's dynamic and QOperator integer ops), fp16, bf16, or fp32; '+' joins
    mixes. (Q/DQ alone had been read as int8: a dynamic int8 or an int4 bundle was labelled fp32.)"""
    nodes = list(_all_nodes(model))
    integer = {nbits_precision(node) for node in nodes if node.op_type == "MatMulNBits"}
    if any(node.op_type in QDQ_OPS or node.op_type in INTEGER_OPS for node in nodes):
        integer.add("int8")
    types = _float_types(model, nodes)
    half = [name for name, code in (("fp16", TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16)) if code in types]
    parts = sorted(integer) + half
    return "+".join(parts) or "fp32"


def _float_types(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> set[int]:
    """Element types of initializers, graph inputs/outputs and Cast targets."""
    types = {init.data_type for init in model.graph.initializer}
    types |= {value.type.tensor_type.elem_type for value in list(model.graph.input) + list(model.graph.output)}
    for node in nodes:
        if node.op_type == "Cast":
            types |= {attr.i for attr in node.attribute if attr.name == "to"}
        if node.op_type == "Constant":
            types |= {attr.t.data_type for attr in node.attribute if attr.name == "value"}
    return types


def sparse_2to4_layers(model: onnx.ModelProto) -> dict[str, int]:
    """How many MatMul/Gemm/Conv weights follow the 2:4 pattern TensorRT's sparse kernels need.

    2:4 means: along the reduction (input-channel) axis, every group of 4 weights holds at
    least 2 zeros. Weights behind a DequantizeLinear are checked as their quantized values.
    The model must be loaded with its external data.
    """
    initializers = {init.name: init for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    eligible = qualifying = 0
    for node in model.graph.node:
        if node.op_type not in SPARSE_CANDIDATES or len(node.input) < 2:
            continue
        weight = _weight(node.input[1], initializers, producers)
        if weight is None or weight.ndim < 2:
            continue
        axis = _reduction_axis(node)
        if weight.shape[axis] % 4:
            continue
        eligible += 1
        qualifying += int(_is_2to4(weight, axis))
    return {"eligible": eligible, "sparse_2to4": qualifying}


def _weight(name: str, initializers: dict, producers: dict) -> np.ndarray | None:
    if name in initializers:
        return numpy_helper.to_array(initializers[name])
    node = producers.get(name)
    if node is not None and node.op_type == "DequantizeLinear" and node.input[0] in initializers:
        return numpy_helper.to_array(initializers[node.input[0]])
    return None


def _reduction_axis(node: onnx.NodeProto) -> int:
    if node.op_type == "Conv":
        return 1  # [out, in/groups, kh, kw]
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        return 1  # B is [N, K]
    return 0  # MatMul / Gemm: B is [K, N]


def _is_2to4(weight: np.ndarray, axis: int) -> bool:
    moved = np.moveaxis(weight, axis, -1)
    groups = moved.reshape(-1, 4)
    return bool(((groups == 0).sum(axis=1) >= 2).all())


def info_says_2to4(info: Any) -> bool:
    """Whether a stage's info.json mentions a 2:4 pattern anywhere (the prune pass records it)."""
    if isinstance(info, dict):
        return any(info_says_2to4(v) for v in info.values())
    if isinstance(info, (list, tuple)):
        return any(info_says_2to4(v) for v in info)
    return isinstance(info, str) and info.replace(" ", "") in ("2:4", "2to4")


def _all_nodes(model: onnx.ModelProto):
    """Every node, including those in subgraphs (If/Loop bodies) and local functions."""
    stack = [model.graph] + [fn for fn in model.functions]
    while stack:
        graph = stack.pop()
        for node in graph.node:
            yield node
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(attr.graphs)
