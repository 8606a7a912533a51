"""Facts about an ONNX graph: op histogram, node and initializer counts, bytes by dtype,
inputs/outputs with their dims, fused ops, and what changed between two graphs."""
from __future__ import annotations

from collections import Counter
from typing import Any

import onnx
from onnx import TensorProto, helper

#: Ops in this domain are ONNX Runtime's fused kernels (Attention, SkipLayerNormalization, ...).
FUSED_DOMAIN = "com.microsoft"
#: Ops that mark where a graph changes precision: quantization boundaries and casts.
PRECISION_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Cast")


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(_op_name(n) for n in model.graph.node).items()))


def graph_stats(model: onnx.ModelProto) -> dict[str, Any]:
    bytes_by_dtype: Counter[str] = Counter()
    params = 0
    for init in model.graph.initializer:
        count = _element_count(init.dims)
        params += count
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        bytes_by_dtype[_dtype_name(init.data_type)] += count * dtype.itemsize
    return {
        "nodes": len(model.graph.node),
        "ops": op_histogram(model),
        "initializers": len(model.graph.initializer),
        "parameters": params,
        "bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
        "opsets": {d.domain or "ai.onnx": d.version for d in model.opset_import},
    }


def io_signature(model: onnx.ModelProto) -> dict[str, list[dict[str, Any]]]:
    """The graph's inputs and outputs: name, element type and dims (ints fixed, strings symbolic)."""
    initializers = {init.name for init in model.graph.initializer}
    return {
        "inputs": [_value_info(v) for v in model.graph.input if v.name not in initializers],
        "outputs": [_value_info(v) for v in model.graph.output],
    }


def fused_ops(ops: dict[str, int]) -> dict[str, int]:
    """The com.microsoft ops of an op histogram: what a fusion pass produced."""
    prefix = FUSED_DOMAIN + "."
    return {op.removeprefix(prefix): n for op, n in ops.items() if op.startswith(prefix)}


def precision_mix(bytes_by_dtype: dict[str, int]) -> dict[str, float]:
    """Share of the weight bytes held in each dtype (0..1), largest first."""
    total = sum(bytes_by_dtype.values())
    if not total:
        return {}
    return dict(sorted(((dt, n / total) for dt, n in bytes_by_dtype.items()), key=lambda kv: -kv[1]))


def describe_graph(model: onnx.ModelProto) -> dict[str, Any]:
    """Everything `optpipe inspect` shows about a graph, as data."""
    stats = graph_stats(model)
    return {
        **stats,
        **io_signature(model),
        "fused_ops": fused_ops(stats["ops"]),
        "precision_ops": {op: n for op, n in stats["ops"].items() if op in PRECISION_OPS},
        "precision_mix": precision_mix(stats["bytes_by_dtype"]),
        "weight_bytes": sum(stats["bytes_by_dtype"].values()),
    }


def op_changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per op type, how many were added (+) or removed (-)."""
    return {op: after.get(op, 0) - before.get(op, 0) for op in sorted(set(before) | set(after)) if after.get(op, 0) != before.get(op, 0)}


def graph_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What changed from one described graph (describe_graph) to another."""
    changes = op_changes(before["ops"], after["ops"])
    dtypes = sorted(set(before["bytes_by_dtype"]) | set(after["bytes_by_dtype"]))
    return {
        "ops_added": {op: n for op, n in changes.items() if n > 0},
        "ops_removed": {op: -n for op, n in changes.items() if n < 0},
        "nodes": (before["nodes"], after["nodes"]),
        "initializers": (before["initializers"], after["initializers"]),
        "parameters": (before["parameters"], after["parameters"]),
        "weight_bytes": (before["weight_bytes"], after["weight_bytes"]),
        "bytes_by_dtype": {dt: (before["bytes_by_dtype"].get(dt, 0), after["bytes_by_dtype"].get(dt, 0)) for dt in dtypes},
        "fused_ops": (before["fused_ops"], after["fused_ops"]),
        "io_changed": _io_names(before) != _io_names(after),
    }


def _io_names(described: dict[str, Any]) -> tuple:
    return tuple((v["name"], v["dtype"], tuple(v["shape"])) for key in ("inputs", "outputs") for v in described[key])


def _value_info(value: onnx.ValueInfoProto) -> dict[str, Any]:
    tensor = value.type.tensor_type
    dims: list[int | str | None] = []
    if tensor.HasField("shape"):
        for d in tensor.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return {"name": value.name, "dtype": _dtype_name(tensor.elem_type) if tensor.elem_type else "unknown", "shape": dims}


def _element_count(dims) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def _dtype_name(data_type: int) -> str:
    return TensorProto.DataType.Name(data_type).lower()


def _op_name(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
