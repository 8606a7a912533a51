"""A pooling window that covers its whole input, rewritten as the global pooling it computes.

Hugging Face's EfficientNet ends in `nn.AvgPool2d(config.hidden_dim, ceil_mode=True)`: a 2560 x 2560 window over
a 2 x 2 (at 64 px; 19 x 19 at 600 px) feature map. PyTorch and ONNX Runtime take it as the global average it is
(with ceil_mode, one window, clipped to the input), but OpenVINO's ONNX frontend refuses it ("Kernel after
dilation has size (dim: 2560) larger than the data shape after padding (dim: 2)"), so every OpenVINO stage of
every HF EfficientNet failed. Neither onnxsim nor onnxslim rewrites it (a rule of this shape is in no library
optpipe uses), hence this module. Rewritten only where the result is provably the same: the input's spatial
dims static, no padding or dilation, and one window per axis that starts at 0 and covers the input.
"""
from __future__ import annotations

import onnx

from optpipe.graph.edit import node_attribute

POOLS = {"AveragePool": "GlobalAveragePool", "MaxPool": "GlobalMaxPool"}


def whole_input_pools_as_global(model: onnx.ModelProto) -> list[str]:
    """Rewrite `model` in place (its graph; weights need not be loaded); returns the rewritten nodes' names."""
    pools = [n for n in model.graph.node if n.op_type in POOLS and n.domain in ("", "ai.onnx") and len(n.output) == 1]
    if not pools:
        return []
    spatial = _spatial_dims(model, {n.input[0] for n in pools})
    rewritten = []
    for node in pools:
        dims = spatial.get(node.input[0])
        if dims is None or not _one_window(node, dims):
            continue
        node.op_type = POOLS[node.op_type]
        del node.attribute[:]
        rewritten.append(node.name or node.output[0])
    return rewritten


def _one_window(node: onnx.NodeProto, dims: list[int]) -> bool:
    """One window per axis, starting at 0 and covering the input: the output is 1 x 1 and its value the global one.
    Without ceil_mode the window must fit exactly; with it, it may overhang by less than a stride (ONNX's
    output size ceil((dim - kernel) / stride) + 1 is then 1; the overhang is outside the input and counts
    nothing, as the pads are 0)."""
    kernel = list(node_attribute(node, "kernel_shape", []))
    strides = list(node_attribute(node, "strides", [])) or [1] * len(kernel)
    plain = (not any(node_attribute(node, "pads", [])) and not any(d != 1 for d in node_attribute(node, "dilations", []))
             and node_attribute(node, "auto_pad", b"NOTSET") in (b"NOTSET", b"VALID"))
    if not plain or len(kernel) != len(dims) or len(strides) != len(dims):
        return False
    ceil = bool(node_attribute(node, "ceil_mode", 0))
    return all(k == d or (ceil and d <= k < d + s) for k, s, d in zip(kernel, strides, dims))


def _spatial_dims(model: onnx.ModelProto, names: set[str]) -> dict[str, list[int]]:
    """The static spatial dims (after batch and channels) of the named tensors, by ONNX's shape inference on
    the graph as it is: a dim that depends on a dynamic input dim stays unknown, and that tensor is left out."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - a graph ONNX's inference rejects: nothing is rewritten
        return {}
    found = {}
    for value in [*inferred.input, *inferred.value_info]:
        if value.name not in names or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim[2:]
        if dims and all(d.HasField("dim_value") for d in dims):
            found[value.name] = [d.dim_value for d in dims]
    return found
