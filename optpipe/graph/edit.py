"""Small, generic edits of ONNX graphs that several passes need."""
from __future__ import annotations

import onnx


def name_unnamed_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every unnamed node a unique name: passes address nodes by name (block lists, reports),
    and an empty name would match every unnamed node at once."""
    taken = {node.name for node in model.graph.node}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            candidate = f"{node.op_type}_{index}"
            while candidate in taken:
                candidate += "_"
            node.name = candidate
            taken.add(candidate)
    return model


def topologically_sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX requires nodes in topological order; tools that append nodes break it (onnx-ir sorts)."""
    import onnx_ir as ir
    from onnx_ir.passes.common import TopologicalSortPass

    ir_model = ir.from_proto(model)
    TopologicalSortPass()(ir_model)
    return ir.to_proto(ir_model)
