"""Tensor shapes of a graph at fixed input dims, for counting MACs: weights may be absent and
com.microsoft ops (ORT's fusers' and quantizers') may be anywhere.

ONNX's shape inference knows no com.microsoft op; ORT's symbolic shape inference knows the float
ones (Attention, MultiHeadAttention, SkipLayerNormalization, EmbedLayerNormalization, ...) but
not the quantized ones its own quantizer writes (QAttention, QGemm, DynamicQuantizeMatMul,
MatMulIntegerToFloat, ...): it guesses a rank with unknown dims, and every op downstream loses
its shape. Shapes are therefore inferred on a copy in which each such op is replaced by a "twin":
the standard (or ORT-known) ops that give the same output shape, integer operands cast to float
to satisfy the type constraints. Only the copy's shapes are used, never its values.
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import onnx
from onnx import TensorProto, helper

log = logging.getLogger("optpipe.shapes")

#: Tensor name -> (element type, concrete dims or None where any dim is unknown).
ValueTypes = dict[str, tuple[int, Optional[list[int]]]]


def infer_shapes(model: onnx.ModelProto, dims: dict[str, int], known: Callable[[ValueTypes], bool]) -> ValueTypes:
    """The types and shapes of `model`'s tensors with symbolic input dims fixed to `dims` (others 1).

    `known(types)`: whether the shapes found are enough (the caller's compute nodes all have theirs);
    ONNX's C++ inference (a ResNet-50 in well under a second) answers first, ORT's symbolic
    inference (pure Python, ~10x slower, knows the float com.microsoft ops) only where it is not.
    """
    fixed = shape_copy(model, dims)
    types: ValueTypes = {}
    try:
        types = value_types(onnx.shape_inference.infer_shapes(fixed, data_prop=True))
        if known(types):
            return types
    except Exception as exc:
        log.debug("onnx shape inference failed (%s); trying ORT's symbolic shape inference", exc)
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inferred = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True, guess_output_rank=True)
        if inferred is not None:
            return value_types(inferred)
    except Exception as exc:  # it gives up on some graphs: the caller reports the nodes left without shapes
        log.debug("symbolic shape inference failed (%s); MACs of unknown shapes are not counted", exc)
    return types or value_types(fixed)


def shape_copy(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """A copy of `model` ready for shape inference: fixed input dims, no stale value_info, weights
    whose data is elsewhere (external data not loaded) turned into graph inputs of the same dims
    (ORT's symbolic inference reads an initializer's values whenever it can and fails on absent
    data), and the com.microsoft ops no inference knows replaced by their twins."""
    fixed = copy.deepcopy(model)
    for value in fixed.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value"):
                dim.dim_value = int(dims.get(dim.dim_param, 1))
    del fixed.graph.value_info[:]  # stale value_info from earlier passes would contradict the new dims
    graph = fixed.graph
    absent = [init for init in graph.initializer if init.data_location == TensorProto.EXTERNAL and not init.raw_data]
    if absent:
        inputs = {value.name for value in graph.input}
        graph.input.extend(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
                           for init in absent if init.name not in inputs)
        moved = {init.name for init in absent}
        kept = [init for init in graph.initializer if init.name not in moved]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    weights = {init.name: init for init in model.graph.initializer}  # dims and type only are read
    nodes = []
    for node in graph.node:
        twin = TWINS.get(node.op_type) if node.domain == "com.microsoft" else None
        nodes.extend(twin(node, weights) if twin else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    return fixed


def value_types(model: onnx.ModelProto) -> ValueTypes:
    found = {}
    graph = model.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim] if tensor.HasField("shape") else None
        found[value.name] = (tensor.elem_type, None if shape is None or None in shape else shape)
    for init in graph.initializer:
        found[init.name] = (init.data_type, list(init.dims))
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    found[node.output[0]] = (attr.t.data_type, list(attr.t.dims))
    return found


# --- twins: the ops computing the same output shape ----------------------------------------------


def _attrs(node: onnx.NodeProto, names: set[str]) -> list[onnx.AttributeProto]:
    return [attr for attr in node.attribute if attr.name in names]


def _twin_node(op: str, inputs: list[str], outputs: list[str], node: onnx.NodeProto, attrs=(), domain: str = "") -> onnx.NodeProto:
    twin = helper.make_node(op, inputs, outputs, name=f"{node.output[0]}__twin", domain=domain)
    twin.attribute.extend(attrs)
    return twin


def _as_float(name: str, node: onnx.NodeProto) -> tuple[str, onnx.NodeProto]:
    """An integer operand cast to float (the twin's type constraints want float)."""
    out = f"{name}__twin_float_{node.output[0]}"
    return out, helper.make_node("Cast", [name], [out], to=TensorProto.FLOAT)


def _output_type(name: str, weights: dict[str, TensorProto], default: int) -> int:
    """A quantized op's output type is its output zero point's (or scale's): an initializer, usually."""
    return weights[name].data_type if name in weights else default


def _finish(node: onnx.NodeProto, out_type: int, ops: list[onnx.NodeProto], result: str) -> list[onnx.NodeProto]:
    """Cast the twin's float result to the op's own output type (uint8 for a quantized output)."""
    return [*ops, helper.make_node("Cast", [result], [node.output[0]], to=out_type)]


def _without_activation(op: str) -> Callable:
    """FusedConv = Conv + activation (+ Z, which has the output's shape); FusedGemm = Gemm + activation."""

    def twin(node, weights):
        return [_twin_node(op, list(node.input[:3]), list(node.output), node,
                           [a for a in node.attribute if not a.name.startswith("activation")])]

    return twin


def _fused_matmul(node, weights):
    """FusedMatMul = alpha * op(A) @ op(B), transA/transB on the last two axes: an Einsum says that
    for any rank. transBatchA/B (batch axes moved) have no such twin: left unknown.
    A rank-2 weight B (an LM head's tied embedding) gets MatMul(A, Transpose(B)) instead: ORT's
    symbolic inference took the Einsum of A [1, 128, 64] and B [500, 64] to [500, 128, 500]."""
    trans = {a.name: a.i for a in node.attribute}
    if trans.get("transBatchA") or trans.get("transBatchB"):
        return [node]
    weight = weights.get(node.input[1])
    if not trans.get("transA") and weight is not None and len(weight.dims) == 2:
        if not trans.get("transB"):
            return [_twin_node("MatMul", list(node.input[:2]), list(node.output), node)]
        flipped = f"{node.input[1]}__twin_t_{node.output[0]}"
        return [helper.make_node("Transpose", [node.input[1]], [flipped], perm=[1, 0]),
                _twin_node("MatMul", [node.input[0], flipped], list(node.output), node)]
    a = "...ji" if trans.get("transA") else "...ij"
    b = "...kj" if trans.get("transB") else "...jk"
    return [_twin_node("Einsum", list(node.input[:2]), list(node.output), node,
                       [helper.make_attribute("equation", f"{a},{b}->...ik")])]


def _qgemm(node, weights):
    """QGemm(A, a_scale, a_zp, B, b_scale, b_zp, C, y_scale, y_zp): Y is float without y_scale."""
    (a, cast_a), (b, cast_b) = _as_float(node.input[0], node), _as_float(node.input[3], node)
    quantized_out = len(node.input) > 7 and bool(node.input[7])
    out_type = _output_type(node.input[8] if len(node.input) > 8 else "", weights, TensorProto.UINT8) if quantized_out else TensorProto.FLOAT
    gemm = _twin_node("Gemm", [a, b], [f"{node.output[0]}__twin"], node, _attrs(node, {"transA", "transB", "alpha"}))
    return _finish(node, out_type, [cast_a, cast_b, gemm], gemm.output[0])


def _matmul_to_float(scale_index: int) -> Callable:
    """DynamicQuantizeMatMul(A float, B int8, ...) and MatMulIntegerToFloat(A int8, B int8, a_scale, ...):
    a float MatMul's shape, in the type of the scale at `scale_index` (b_scale, a_scale: the output's)."""

    def twin(node, weights):
        casts, operands = [], []
        for name in node.input[:2]:
            operand, cast = _as_float(name, node)
            casts.append(cast)
            operands.append(operand)
        matmul = _twin_node("MatMul", operands, [f"{node.output[0]}__twin"], node)
        scale = node.input[scale_index] if len(node.input) > scale_index else ""
        return _finish(node, _output_type(scale, weights, TensorProto.FLOAT), [*casts, matmul], matmul.output[0])

    return twin


def _qattention(node, weights):
    """QAttention(input, weight, bias, input_scale, weight_scale, mask_index, input_zp, weight_zp, past):
    ORT's float Attention on the same shapes."""
    (x, cast_x), (w, cast_w) = _as_float(node.input[0], node), _as_float(node.input[1], node)
    rest = [node.input[2]] + [node.input[i] if len(node.input) > i else "" for i in (5, 8)]
    while rest and not rest[-1]:
        rest.pop()
    attention = _twin_node("Attention", [x, w, *rest], list(node.output), node,
                           _attrs(node, {"num_heads", "unidirectional", "qkv_hidden_sizes", "past_present_share_buffer",
                                         "do_rotary", "mask_filter_value", "scale"}), domain="com.microsoft")
    return [cast_x, cast_w, attention]


def _same_as_first(node, weights):
    """Element-wise QLinear ops of one operand (QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax):
    the output has the input's shape and quantized type."""
    return [_twin_node("Identity", [node.input[0]], [node.output[0]], node)]


def _qlinear_concat(node, weights):
    """QLinearConcat(Y_scale, Y_zp, X1, x1_scale, x1_zp, X2, ...)."""
    return [_twin_node("Concat", list(node.input[2::3]), [node.output[0]], node, _attrs(node, {"axis"}))]


def _qlinear_pool(op: str, attrs: set[str]) -> Callable:
    """QLinearAveragePool / QLinearGlobalAveragePool(X, x_scale, x_zp, y_scale, y_zp) in NCHW;
    channels_last has no standard twin: left unknown."""

    def twin(node, weights):
        if any(a.name == "channels_last" and a.i for a in node.attribute):
            return [node]
        x, cast = _as_float(node.input[0], node)
        pool = _twin_node(op, [x], [f"{node.output[0]}__twin"], node, _attrs(node, attrs))
        out_type = _output_type(node.input[4] if len(node.input) > 4 else "", weights, TensorProto.UINT8)
        return _finish(node, out_type, [cast, pool], pool.output[0])

    return twin


#: com.microsoft op -> its twin for shape inference. The float ones ORT's symbolic inference knows
#: (Attention, MultiHeadAttention, NhwcConv, QLinearAdd, ...) are not here; FusedConv/FusedGemm
#: are, so that ONNX's much faster inference covers a fused CNN on its own.
TWINS: dict[str, Callable] = {
    "FusedConv": _without_activation("Conv"), "FusedGemm": _without_activation("Gemm"), "FusedMatMul": _fused_matmul,
    "QGemm": _qgemm, "QAttention": _qattention,
    "DynamicQuantizeMatMul": _matmul_to_float(2), "MatMulIntegerToFloat": _matmul_to_float(2),
    "QLinearSigmoid": _same_as_first, "QLinearLeakyRelu": _same_as_first, "QLinearSoftmax": _same_as_first,
    "QLinearConcat": _qlinear_concat,
    "QLinearAveragePool": _qlinear_pool("AveragePool", {"auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides"}),
    "QLinearGlobalAveragePool": _qlinear_pool("GlobalAveragePool", set()),
}
