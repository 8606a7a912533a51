"""Small, generic reads and edits of ONNX graphs that several passes need."""
from __future__ import annotations

import onnx


def node_attribute(node: onnx.NodeProto, name: str, default):
    """The node's attribute `name` as a Python value, or `default` where the node leaves it out
    (onnx.helper.get_node_attr_value raises instead)."""
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def read_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the graph reads: its nodes' inputs and its outputs (what an edit must not drop)."""
    return {name for node in graph.node for name in node.input} | {out.name for out in graph.output}


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
