"""Facts about an ONNX graph: op histogram, node and initializer counts, bytes by dtype."""
from __future__ import annotations

from collections import Counter
from typing import Any

import onnx
from onnx import TensorProto, helper


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(_op_name(n) for n in model.graph.node).items()))


def graph_stats(model: onnx.ModelProto) -> dict[str, Any]:
    bytes_by_dtype: Counter[str] = Counter()
    params = 0
    for init in model.graph.initializer:
        count = 1
        for d in init.dims:
            count *= d
        params += count
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        bytes_by_dtype[TensorProto.DataType.Name(init.data_type).lower()] += count * dtype.itemsize
    return {
        "nodes": len(model.graph.node),
        "ops": op_histogram(model),
        "initializers": len(model.graph.initializer),
        "parameters": params,
        "bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
        "opsets": {d.domain or "ai.onnx": d.version for d in model.opset_import},
    }


def op_changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per op type, how many were added (+) or removed (-)."""
    return {op: after.get(op, 0) - before.get(op, 0) for op in sorted(set(before) | set(after)) if after.get(op, 0) != before.get(op, 0)}


def _op_name(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
