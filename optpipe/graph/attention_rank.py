"""Repair of onnxscript's MultiHeadAttention fusion on decoders that flatten the attention output.

onnxscript's MHA rule (onnxscript/rewriter/ort_fusions/mha.py, "TODO: verify Reshapes") matches
attention ending in Reshape(Transpose(sdpa)) and replaces it with MultiHeadAttention, whose output
is always (B, S, D). GPT-2 (Conv1D = addmm) reshapes to (B*S, D) there, so the rank-2 Gemm that
follows then gets a rank-3 input and ONNX Runtime refuses the graph ("Gemm ... expected to have
rank 2 but has rank 3"). The replaced value keeps the rank the original graph gave it, so putting
the Reshape back where that rank was 2 restores the original semantics exactly.
"""
from __future__ import annotations

ATTENTION_OPS = ("MultiHeadAttention", "Attention")


def restore_flattened_attention(model) -> int:
    """Insert Reshape(-1, D) after every fused attention whose output the graph declares rank 2.
    `model` is an onnx_ir Model, changed in place; returns the number of Reshapes inserted."""
    import numpy as np
    import onnx_ir as ir

    graph = model.graph
    repaired = 0
    for node in list(graph):
        if node.op_type not in ATTENTION_OPS or node.domain != "com.microsoft":
            continue
        out = node.outputs[0]
        if out.shape is None or len(out.shape) != 2 or not out.uses():
            continue
        hidden = out.shape[1]
        if not isinstance(hidden, int):
            continue
        users = list(out.uses())
        flat = ir.Value(name=f"{out.name}_flat", shape=out.shape, type=out.type)
        target = ir.Value(name=f"{out.name}_flat_shape")
        const = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(np.array([-1, hidden], np.int64)))], outputs=[target])
        reshape = ir.Node("", "Reshape", [out, target], outputs=[flat])
        graph.insert_after(node, [const, reshape])
        for user, index in users:
            user.replace_input_with(index, flat)
        out.shape = None  # it is (B, S, D) now; let shape inference say so
        repaired += 1
    return repaired
