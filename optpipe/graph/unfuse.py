"""Undo ONNX Runtime's generic conv/gemm fusions: com.microsoft FusedConv / FusedGemm back into
the standard op followed by its activation.

Why: ORT's quantizer knows Conv and Gemm but not their fused forms, so int8 after `fuse` on a
CNN quantized only the final Gemm (under 1% of the weights). Splitting the fused ops first
loses nothing: ORT fuses Conv+activation again when it loads the quantized (QDQ) graph, in
the form its int8 kernels take. Graph arithmetic is unchanged (same weights, same ops).
"""
from __future__ import annotations

import onnx
from onnx import helper

MS_DOMAIN = "com.microsoft"
CONV_ATTRS = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}
GEMM_ATTRS = {"alpha", "beta", "transA", "transB"}


def unfuse(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `model` with FusedConv / FusedGemm split; and how many of each were split."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes, counts = [], {}
    for node in out.graph.node:
        split = _split(node, out.graph) if node.domain == MS_DOMAIN else None
        if split is None:
            nodes.append(node)
            continue
        nodes.extend(split)
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    if counts:
        del out.graph.node[:]
        out.graph.node.extend(nodes)
        _ensure_opset(out)
    return out, counts


def has_fused_ops(model: onnx.ModelProto) -> bool:
    return any(node.domain == MS_DOMAIN and node.op_type in ("FusedConv", "FusedGemm") for node in model.graph.node)


def _split(node: onnx.NodeProto, graph: onnx.GraphProto) -> list[onnx.NodeProto] | None:
    if node.op_type == "FusedConv":
        base_op, kept, inputs, extra = "Conv", CONV_ATTRS, node.input[:3], node.input[3] if len(node.input) > 3 else ""
    elif node.op_type == "FusedGemm":
        base_op, kept, inputs, extra = "Gemm", GEMM_ATTRS, node.input[:3], ""
    else:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    activation = attrs.get("activation", b"")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    name = node.name or node.output[0]
    base_out = f"{name}/{base_op.lower()}_out"
    result = [helper.make_node(base_op, list(inputs), [base_out], name=f"{name}/{base_op.lower()}",
                               **{k: v for k, v in attrs.items() if k in kept})]
    if extra:  # FusedConv's Z: added to the convolution before the activation
        result.append(helper.make_node("Add", [base_out, extra], [f"{name}/sum"], name=f"{name}/add"))
        base_out = f"{name}/sum"
    act = _activation(activation, attrs, name, base_out, node.output[0], graph)
    if act is None:
        return None  # an activation we cannot express: leave the fused op as is (coverage reports it)
    result.extend(act)
    return result


def _activation(kind: str, attrs: dict, name: str, x: str, y: str, graph: onnx.GraphProto) -> list[onnx.NodeProto] | None:
    params = list(attrs.get("activation_params", [])) or [attrs[k] for k in ("activation_alpha", "activation_beta") if k in attrs]
    node_name = f"{name}/{kind.lower() or 'identity'}"
    if kind in ("", "Identity"):
        return [helper.make_node("Identity", [x], [y], name=node_name)]
    if kind in ("Relu", "Tanh", "Sigmoid"):
        return [helper.make_node(kind, [x], [y], name=node_name)]
    if kind == "LeakyRelu":
        return [helper.make_node(kind, [x], [y], name=node_name, alpha=params[0] if params else 0.01)]
    if kind == "HardSigmoid":
        alpha, beta = (params + [0.2, 0.5][len(params):])[:2]
        return [helper.make_node(kind, [x], [y], name=node_name, alpha=alpha, beta=beta)]
    if kind == "Clip" and len(params) == 2:
        low, high = f"{name}/clip_min", f"{name}/clip_max"
        graph.initializer.extend([helper.make_tensor(low, onnx.TensorProto.FLOAT, [], [params[0]]),
                                  helper.make_tensor(high, onnx.TensorProto.FLOAT, [], [params[1]])])
        return [helper.make_node("Clip", [x, low, high], [y], name=node_name)]
    return None


def _ensure_opset(model: onnx.ModelProto) -> None:
    if not any(op.domain in ("", "ai.onnx") for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", 17))
