"""Structured pruning on an ONNX graph: find the channel groups that can lose channels together, and remove them.

A *channel group* is a set of tensors whose channel axis must keep the same channels:
a Conv's (or weight-MatMul's) output, everything that flows from it through
channel-wise ops (BatchNormalization, Relu, pooling, element-wise math with
constants), tensors joined to it by an element-wise Add/Mul (a residual), and the
input-channel axis of every Conv/MatMul/Gemm that reads it. Removing channel c
from a group means deleting, in every weight that touches the group, the slice
for c: output rows of the producers, per-channel BatchNorm/bias values, input
rows of the consumers. Any tensor of the group that is read by an op whose
channel semantics are not known here (Reshape, LayerNormalization, Softmax, a
graph output, ...) makes the whole group unprunable: that is what "where sound"
means, and is why a transformer's hidden stream (LayerNorm, head reshapes) stays
whole while its FFN neurons (MatMul -> bias -> GELU -> MatMul) can go.

The union-find walk follows the pattern of torch-pruning's dependency graph; it is
written here because that library works on torch modules, and this pass runs on
the exported, simplified ONNX graph (see docs/prune.md for why).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from optpipe.graph.edit import node_attribute

CHANNELWISE_UNARY = {
    "Relu", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Gelu", "Erf", "Elu", "Selu",
    "Celu", "Softplus", "Softsign", "Mish", "Clip", "Identity", "Dropout", "Neg", "Abs", "Sqrt", "Exp", "Log",
    "Reciprocal", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Floor", "Ceil", "Round",
}
ELEMENTWISE_BINARY = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Sum"}


@dataclass
class WeightSlice:
    """One axis of one initializer that follows a group's channels."""

    initializer: str
    axis: int
    node: str
    op: str = ""


# What each kind of record adds to, in a ChannelGroup.
RECORD_LISTS = {
    "producer": "producers",
    "consumer": "consumers",
    "param": "params",
    "bn_scale": "bn_scales",
    "depthwise": "depthwise",
    "blocker": "blockers",
}


@dataclass
class ChannelGroup:
    root: str
    channels: int | None = None
    producers: list[WeightSlice] = field(default_factory=list)
    consumers: list[WeightSlice] = field(default_factory=list)
    params: list[WeightSlice] = field(default_factory=list)  # BatchNorm scale/bias/mean/var, biases
    bn_scales: list[np.ndarray] = field(default_factory=list)
    depthwise: list[str] = field(default_factory=list)  # depthwise Convs whose `group` follows the channels
    blockers: list[str] = field(default_factory=list)
    tensors: list[str] = field(default_factory=list)

    @property
    def prunable(self) -> bool:
        return bool(self.producers) and not self.blockers and self.channels is not None

    @property
    def kind(self) -> str:
        ops = sorted({piece.op for piece in self.producers})
        return "Conv output channels" if ops == ["Conv"] else "/".join(ops) + " output features (neurons)"

    def slices(self) -> list[WeightSlice]:
        return self.producers + self.consumers + self.params


class _UnionFind:
    def __init__(self):
        self.parent: dict[str, str] = {}

    def add(self, name: str) -> None:
        self.parent.setdefault(name, name)

    def find(self, name: str) -> str:
        root = name
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[name] != root:
            self.parent[name], name = root, self.parent[name]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def constants_to_initializers(model: onnx.ModelProto) -> None:
    """Constant nodes become initializers, so biases and scales are sliced the same way wherever they live."""
    keep = []
    for node in model.graph.node:
        value = next((a for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and value is not None:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value.t)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)


class GroupFinder:
    """Walks the graph once, in topological order, building the channel groups."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.weights = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
        self.shapes = _inferred_shapes(model)
        self.uses: dict[str, int] = defaultdict(int)
        for node in model.graph.node:
            for name in node.input:
                self.uses[name] += 1
        self.uf = _UnionFind()
        self.axis: dict[str, int] = {}  # channel axis of each tracked tensor, counted from the end
        self.rank: dict[str, int | None] = {}  # rank, where a Conv fixes it
        self.records: dict[str, list] = defaultdict(list)  # tensor -> [(kind, payload)]

    def groups(self) -> list[ChannelGroup]:
        for node in self.model.graph.node:
            self._visit(node)
        for out in self.model.graph.output:
            self._block(out.name, f"graph output '{out.name}'")
        return self._collect()

    # --- per op -------------------------------------------------------------------------

    def _visit(self, node: onnx.NodeProto) -> None:
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        if op == "Conv":
            self._conv(node)
        elif op in ("MatMul", "Gemm"):
            self._matmul(node, op)
        elif op == "BatchNormalization":
            self._batchnorm(node)
        elif op in CHANNELWISE_UNARY:
            self._channelwise(node, extra_inputs=node.input[1:])
        elif op in ELEMENTWISE_BINARY:
            self._elementwise(node)
        else:
            for name in node.input:
                self._block(name, f"read by {op} '{node.name}'")

    def _conv(self, node) -> None:
        x, w = node.input[0], node.input[1]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        y = node.output[0]
        weight = self.weights.get(w)
        group = node_attribute(node, "group", 1)
        if weight is None or (bias is not None and bias not in self.weights):
            self._block(x, f"Conv '{node.name}' has computed weights")
            return
        rank = weight.ndim
        if group == 1:
            self._consume(x, WeightSlice(w, 1, node.name))
            self._produce(y, weight.shape[0], -(rank - 1), rank, WeightSlice(w, 0, node.name, "Conv"))
            if bias is not None:
                self._record(y, "param", WeightSlice(bias, 0, node.name))
        elif weight.shape[1] == 1 and group == weight.shape[0]:  # depthwise: one filter per channel
            if self._follow(x, y):
                self._record(y, "param", WeightSlice(w, 0, node.name))
                self._record(y, "depthwise", node.name)
                if bias is not None:
                    self._record(y, "param", WeightSlice(bias, 0, node.name))
        else:
            self._block(x, f"grouped Conv '{node.name}'")

    def _matmul(self, node, op: str) -> None:
        a, b, y = node.input[0], node.input[1], node.output[0]
        weight = self.weights.get(b)
        trans_a, trans_b = node_attribute(node, "transA", 0), node_attribute(node, "transB", 0)
        if weight is None or weight.ndim != 2 or trans_a or a in self.weights:
            for name in node.input:
                self._block(name, f"{op} '{node.name}' without a 2-D weight")
            return
        in_axis, out_axis = (1, 0) if trans_b else (0, 1)
        self._consume(a, WeightSlice(b, in_axis, node.name))
        self._produce(y, weight.shape[out_axis], -1, None, WeightSlice(b, out_axis, node.name, op))
        if op == "Gemm" and len(node.input) > 2 and node.input[2]:
            self._param_like(node.input[2], y, node)

    def _batchnorm(self, node) -> None:
        x, y = node.input[0], node.output[0]
        if not all(name in self.weights for name in node.input[1:5]):
            self._block(x, f"BatchNormalization '{node.name}' with computed parameters")
            return
        if x in self.uf.parent and (self.rank.get(x) is None or self.axis[x] != 1 - self.rank[x]):
            self._block(x, f"BatchNormalization '{node.name}' on a tensor whose channel axis is not axis 1")
            return
        if self._follow(x, y):
            for name in node.input[1:5]:
                self._record(y, "param", WeightSlice(name, 0, node.name))
            scale, _, _, var = (self.weights[n] for n in node.input[1:5])
            eps = node_attribute(node, "epsilon", 1e-5)
            self._record(y, "bn_scale", np.abs(scale) / np.sqrt(var + eps))

    def _channelwise(self, node, extra_inputs) -> None:
        x = node.input[0]
        if any(name and name not in self.weights for name in extra_inputs):
            self._block(x, f"{node.op_type} '{node.name}' with computed parameters")
            return
        if not self._follow(x, node.output[0]):
            return
        for name in extra_inputs:  # e.g. PRelu's slope, Clip's bounds: per-channel when sized like the channels
            if name:
                self._param_like(name, node.output[0], node)

    def _elementwise(self, node) -> None:
        y = node.output[0]
        tracked = [name for name in node.input if name in self.uf.parent]
        computed_other = [name for name in node.input if name not in self.uf.parent and name not in self.weights]
        if not tracked:
            return
        if computed_other:
            for name in tracked:
                self._block(name, f"{node.op_type} '{node.name}' with a tensor whose channels are not tracked")
            return
        sizes = {self._channel_size(name) for name in tracked}
        if len(tracked) > 1 and (None in sizes or len(sizes) > 1):
            for name in tracked:
                self._block(name, f"{node.op_type} '{node.name}' broadcasts across channels")
            return
        self._follow(tracked[0], y)
        for name in tracked[1:]:
            self.uf.union(tracked[0], name)
        for name in node.input:
            if name in self.weights:
                self._param_like(name, y, node)

    # --- bookkeeping --------------------------------------------------------------------

    def _produce(self, tensor: str, channels: int, axis: int, rank: int | None, weight: WeightSlice) -> None:
        self.uf.add(tensor)
        self.axis[tensor] = axis
        self.rank[tensor] = rank
        self._record(tensor, "producer", weight)
        self._record(tensor, "channels", channels)

    def _consume(self, tensor: str, weight: WeightSlice) -> None:
        if tensor in self.uf.parent:
            self._record(tensor, "consumer", weight)

    def _follow(self, source: str, target: str) -> bool:
        """`target` has the same channels as `source` on the same axis (if source is tracked)."""
        if source not in self.uf.parent:
            return False
        self.uf.add(target)
        self.axis[target] = self.axis[source]
        self.rank[target] = self.rank.get(source)
        self.uf.union(source, target)
        return True

    def _param_like(self, name: str, tensor: str, node) -> None:
        """A constant combined element-wise with `tensor`: sliced if it has one value per channel."""
        value = self.weights[name]
        axis = self.axis[tensor]
        if value.ndim >= -axis and value.shape[axis] != 1:
            self._record(tensor, "param", WeightSlice(name, value.ndim + axis, node.name))

    def _record(self, tensor: str, kind: str, payload) -> None:
        self.records[tensor].append((kind, payload))

    def _block(self, tensor: str, reason: str) -> None:
        if tensor in self.uf.parent:
            self._record(tensor, "blocker", reason)

    def _channel_size(self, tensor: str) -> int | None:
        shape = self.shapes.get(tensor)
        axis = self.axis[tensor]
        if shape is None or len(shape) < -axis:
            return None
        return shape[axis] if isinstance(shape[axis], int) else None

    def _collect(self) -> list[ChannelGroup]:
        groups: dict[str, ChannelGroup] = {}
        for tensor in self.uf.parent:
            root = self.uf.find(tensor)
            group = groups.setdefault(root, ChannelGroup(root=root))
            group.tensors.append(tensor)
            for kind, payload in self.records.get(tensor, []):
                if kind == "channels":
                    if group.channels not in (None, payload):
                        group.blockers.append(f"producers disagree on the channel count ({group.channels} vs {payload})")
                    group.channels = payload
                else:
                    getattr(group, RECORD_LISTS[kind]).append(payload)
        for group in groups.values():
            self._check_slices(group)
        return list(groups.values())

    def _check_slices(self, group: ChannelGroup) -> None:
        """Every weight to cut must have the group's size on that axis and belong to this group alone."""
        per_initializer: dict[str, set[int]] = defaultdict(set)
        for piece in group.slices():
            shape = self.weights[piece.initializer].shape
            if group.channels is not None and shape[piece.axis] != group.channels:
                group.blockers.append(f"'{piece.initializer}' has {shape[piece.axis]} entries on axis {piece.axis}, not {group.channels}")
            per_initializer[piece.initializer].add(piece.axis)
        for name, axes in per_initializer.items():
            if self.uses[name] > 1 and len({p.node for p in group.slices() if p.initializer == name}) < self.uses[name]:
                group.blockers.append(f"initializer '{name}' is shared with nodes outside the group")
            if len(axes) > 1:
                group.blockers.append(f"initializer '{name}' would be cut on two axes by one group")


def importance(group: ChannelGroup, weights: dict[str, np.ndarray]) -> np.ndarray:
    """Per channel: the mean-normalised L2 norms of its weight slices (producers and consumers), summed,
    times the BatchNorm gain |gamma| / sqrt(var + eps) (also mean-normalised) where one follows."""
    score = np.zeros(group.channels)
    for piece in group.producers + group.consumers:
        norms = _norms(weights[piece.initializer], piece.axis)
        score += norms / (norms.mean() or 1.0)
    for gain in group.bn_scales:
        score *= gain / (gain.mean() or 1.0)
    return score


def channels_to_keep(group: ChannelGroup, weights, amount: float, round_to: int, min_channels: int) -> np.ndarray:
    """Indices (sorted) of the channels kept: the most important (1 - amount), rounded up to `round_to`."""
    total = group.channels
    keep = int(np.ceil(total * (1.0 - amount) / round_to) * round_to)
    keep = min(total, max(keep, min(min_channels, total)))
    order = np.argsort(-importance(group, weights), kind="stable")
    return np.sort(order[:keep])


def apply_pruning(model: onnx.ModelProto, plan: dict[str, tuple[ChannelGroup, np.ndarray]]) -> None:
    """Cut every weight slice of every planned group; depthwise Convs get their new `group`; stale shapes go."""
    cuts: dict[str, list[tuple[int, np.ndarray]]] = defaultdict(list)
    new_groups: dict[str, int] = {}
    for group, keep in plan.values():
        for piece in group.slices():
            cuts[piece.initializer].append((piece.axis, keep))
        for node_name in group.depthwise:
            new_groups[node_name] = len(keep)
    for index, init in enumerate(model.graph.initializer):
        if init.name in cuts:
            array = numpy_helper.to_array(init)
            for axis, keep in cuts[init.name]:
                array = np.take(array, keep, axis=axis)
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), init.name))
    for node in model.graph.node:
        if node.name in new_groups:
            for attr in node.attribute:
                if attr.name == "group":
                    attr.CopyFrom(helper.make_attribute("group", new_groups[node.name]))
    del model.graph.value_info[:]  # intermediate shapes changed; shape inference recomputes them


def _norms(weight: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(weight.astype(np.float64), axis, 0)
    return np.sqrt((moved.reshape(moved.shape[0], -1) ** 2).sum(axis=1))



def _inferred_shapes(model: onnx.ModelProto) -> dict[str, list]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # shape inference is a help, not a requirement: unknown shapes block broadcasts only
        return {}
    shapes = {}
    for info in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if info.type.tensor_type.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]
    return shapes
