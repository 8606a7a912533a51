"""Constant weights that reach a MatMul in forms weight-only quantizers do not take, rewritten as MatMul weights.

ONNX Runtime's MatMulNBits quantizer takes a MatMul whose second input is an initializer, nothing else:

- **Gemm.** The dynamo exporter writes `torch.addmm` (GPT-2's Conv1D, any `nn.Linear` on a 2-D input) as Gemm: on
  a tiny GPT-2 every weight was in a Gemm, and the weight_only pass found nothing to quantize. onnxscript's
  gemm_to_matmul_add rule matches only a Gemm between two Reshapes with alpha = beta = 1 and a bias, so this does
  it by hand for any Gemm whose B is an initializer: Y = alpha * A @ op(B) + beta * C becomes
  MatMul(A, alpha * op(B)) + beta * C. The Gemm's name goes to the MatMul, so `exclude` lists and reports still
  find the layer; B is copied only where transB or alpha changes it.
- **A transposed initializer.** A tied LM head (Gemma, GPT-2, Llama 3.2 1B) multiplies by the embedding table
  through a Transpose, which ONNX Runtime folds only when a session loads the model: the quantizer saw no constant
  weight, and Gemma 3 270M's largest MatMul (63% of its MACs, a third of each decode step's weight reads) stayed
  FP32 in every ORT weight-only stage. The transposed table becomes an initializer of its own; the Gather keeps
  the table.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from optpipe.graph.edit import node_attribute, read_names


def gemms_as_matmuls(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place; returns how many Gemms became MatMuls (those with transA or a B that is not
    a 2-D initializer stay Gemms)."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    rewritten, nodes = 0, []
    for node in graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "Gemm" and node.domain in ("", "ai.onnx") else None
        if weight is None or len(weight.dims) != 2 or node_attribute(node, "transA", 0):
            nodes.append(node)
            continue
        nodes += _as_matmul(node, weight, initializers, graph)
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
        _drop_unused(graph)
    return rewritten


def tied_heads(model: onnx.ModelProto, skip: frozenset[str] = frozenset()) -> list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.TensorProto]]:
    """(MatMul, Transpose, table) for each MatMul whose weight is Transpose(initializer, 2-D), but those named in
    `skip`. The table may still be external data: only its dims are read."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    transposes = {node.output[0]: node for node in graph.node if node.op_type == "Transpose" and node.domain in ("", "ai.onnx")
                  and node.input[0] in initializers and len(initializers[node.input[0]].dims) == 2
                  and list(node_attribute(node, "perm", [1, 0])) == [1, 0]}
    return [(node, transposes[node.input[1]], initializers[transposes[node.input[1]].input[0]]) for node in graph.node
            if node.op_type == "MatMul" and node.name not in skip and node.input[1] in transposes]


def transposed_weights_folded(model: onnx.ModelProto, skip: frozenset[str] = frozenset()) -> list[str]:
    """Rewrite `model` in place: each MatMul whose weight is Transpose(initializer, 2-D) takes the transposed
    initializer instead, but those named in `skip` (kept in float: a copy would only add their size). Returns the
    MatMuls' names."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    copies: dict[str, str] = {}
    heads = tied_heads(model, skip)
    for node, transpose, table in heads:
        if transpose.output[0] not in copies:  # one copy per table, however many MatMuls read it
            copies[transpose.output[0]] = _transposed(graph, initializers, table)
        node.input[1] = copies[transpose.output[0]]
    if heads:
        drop_unread_transposes(graph, set(copies))
    return [node.name for node, _, _ in heads]


def drop_unread_transposes(graph: onnx.GraphProto, outputs: set[str]) -> None:
    """The Transposes writing `outputs` that nothing reads any more go, and the weights only they read."""
    read = read_names(graph)
    kept = [node for node in graph.node if not (node.op_type == "Transpose" and node.output[0] in outputs
                                                and node.output[0] not in read)]
    del graph.node[:]
    graph.node.extend(kept)
    _drop_unused(graph)


def _transposed(graph: onnx.GraphProto, initializers: dict, table: onnx.TensorProto) -> str:
    """A new initializer, `table` transposed. Two copies of the table at most at once, not four (to_array's,
    the transposed array, its bytes and the proto's: Gemma 3 270M's 0.67 GB table rose 2.6 GB)."""
    dtype = helper.tensor_dtype_to_np_dtype(table.data_type)
    view = np.frombuffer(table.raw_data, dtype).reshape(table.dims) if table.raw_data else numpy_helper.to_array(table)
    raw = np.ascontiguousarray(view.T).tobytes()  # the contiguous array is dropped as soon as its bytes exist
    del view
    name = _unique(initializers, f"{table.name}/transposed")
    return _add(graph, initializers, helper.make_tensor(name, table.data_type, [table.dims[1], table.dims[0]], raw, raw=True))


def _drop_unused(graph: onnx.GraphProto) -> None:
    """A weight whose only reader took a transposed copy is dropped (the model would carry it twice)."""
    used = read_names(graph)
    kept = [init for init in graph.initializer if init.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def _as_matmul(node: onnx.NodeProto, weight: onnx.TensorProto, initializers: dict, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    alpha, beta = float(node_attribute(node, "alpha", 1.0)), float(node_attribute(node, "beta", 1.0))
    base = node.name or node.output[0]  # an unnamed Gemm's: '/bias' for each of two made a graph ORT refuses
    b_name = weight.name
    if node_attribute(node, "transB", 0) or alpha != 1.0:
        b = numpy_helper.to_array(weight)
        b = np.ascontiguousarray(b.T if node_attribute(node, "transB", 0) else b) * np.asarray(alpha, b.dtype)
        b_name = _new_initializer(graph, initializers, f"{weight.name}/{base}/as_matmul", b)
    has_bias = len(node.input) > 2 and node.input[2] and beta != 0.0
    product = f"{node.output[0]}/matmul" if has_bias else node.output[0]
    nodes = [helper.make_node("MatMul", [node.input[0], b_name], [product], name=node.name)]
    if has_bias:
        bias = node.input[2]
        if beta != 1.0:
            dtype = helper.tensor_dtype_to_np_dtype(initializers[bias].data_type) if bias in initializers else np.float32
            scale = np.asarray(beta, dtype)
            bias_scaled = f"{node.output[0]}/beta_bias"
            nodes.append(helper.make_node("Mul", [bias, _new_initializer(graph, initializers, f"{base}/beta", scale)],
                                          [bias_scaled], name=f"{base}/beta"))
            bias = bias_scaled
        nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=f"{base}/bias"))
    return nodes


def _new_initializer(graph: onnx.GraphProto, initializers: dict, name: str, value: np.ndarray) -> str:
    return _add(graph, initializers, numpy_helper.from_array(value, _unique(initializers, name)))


def _unique(initializers: dict, name: str) -> str:
    while name in initializers:
        name += "_"
    return name


def _add(graph: onnx.GraphProto, initializers: dict, tensor: onnx.TensorProto) -> str:
    graph.initializer.append(tensor)
    initializers[tensor.name] = tensor
    return tensor.name
