"""FP16 numerics measured on a CPU: an FP32 model that rounds every FP16 tensor to FP16.

Why not just run the FP16 model on ONNX Runtime's CPU provider: that provider has
no FP16 kernels for most ops, so it wraps them in Casts to FP32 and then removes
the Cast pairs between neighbouring ops (its InsertCastTransformer). Consecutive
"FP16" ops then compute and pass values in FP32, and a ReduceSum that overflows
FP16 on a GPU gives a finite result on the CPU (measured: bit-identical to FP32).
Explicit Casts that lose precision are kept since ORT 1.17 (PR #17953), so this
module rewrites an FP16 model into FP32 ops with an explicit FP32->FP16->FP32
round trip after every tensor that is FP16 in the original. That is what a GPU
computes: FP16 storage between ops, FP32 arithmetic inside them, overflow to inf.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from optpipe.core.artifact import all_graphs

ROUNDED_SUFFIX = "__fp16_storage"
RAW_SUFFIX = "__fp32_raw"


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor that shape inference can type."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types: dict[str, int] = {}
    for graph in all_graphs(inferred.graph):  # a Loop's or If's body too: its tensors are FP16 as well
        types.update({init.name: init.data_type for init in graph.initializer})
        for info in (*graph.input, *graph.output, *graph.value_info):
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
                types[info.name] = info.type.tensor_type.elem_type
    return types


def emulate_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """An FP32 model whose values equal the FP16 model's under FP16 storage and FP32 arithmetic."""
    types = tensor_types(model)
    emulated = onnx.ModelProto()
    emulated.CopyFrom(model)
    # The bodies of Loop / If / Scan too (one left in FP16 inside an FP32 graph is a type mismatch ONNX Runtime
    # refuses: the fp16 stage of a Loop model failed as an internal error). Reversed depth-first order: each body
    # before the graph holding it, whose node list is rebuilt from copies of its nodes.
    for graph in reversed(list(all_graphs(emulated.graph))):
        _emulate_graph(graph, types)
    return emulated


def _emulate_graph(graph: onnx.GraphProto, types: dict[str, int]) -> None:
    """emulate_fp16 on one graph, its subgraphs aside."""
    for index, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT16:
            graph.initializer[index].CopyFrom(_as_float32(init))
    nodes = []
    for node in graph.node:
        _widen_attributes(node)
        nodes.append(node)
        for position, name in enumerate(node.output):
            if name and types.get(name) == TensorProto.FLOAT16:
                raw = name + RAW_SUFFIX
                node.output[position] = raw
                nodes.append(helper.make_node("Cast", [raw], [name + ROUNDED_SUFFIX], to=TensorProto.FLOAT16))
                nodes.append(helper.make_node("Cast", [name + ROUNDED_SUFFIX], [name], to=TensorProto.FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)
    for info in (*graph.input, *graph.output):
        if info.type.tensor_type.elem_type == TensorProto.FLOAT16:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    del graph.value_info[:]  # types changed; ORT re-infers them


def _widen_attributes(node: onnx.NodeProto) -> None:
    """FP16 constants become FP32 (same values); Casts to FP16 become Casts to FP32 (rounded after)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT16:
            attr.t.CopyFrom(_as_float32(attr.t))
        if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
            attr.i = TensorProto.FLOAT


def _as_float32(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
