"""What precision a graph computes in: the share of its weights (elements and bytes) and of its
multiply-accumulates (MACs) in int4 / int8 / fp16 / fp32 (weight-only MatMulNBits in its weights' bits), and the compute nodes left in float with the reason why.

This is how a stage shows what it changed: an int8 stage that quantized only the final Gemm of
a CNN (because `fuse` had turned every Conv into com.microsoft.FusedConv, which ORT's quantizer
does not know) shows "int8 1% of MACs" instead of a bare "ok".

MACs are counted from tensor shapes (optpipe.graph.shapes: ONNX's and ORT's shape inference, the
com.microsoft quantized ops given twins they know) at the values given for the symbolic input dims
(the recipe's `opt`). A node's MACs are split by where they run: a fused attention's Q/K/V
projection in the node's precision (int8 for QAttention), its scores and context (activation x
activation) in float, as every ORT kernel computes them. Nodes whose shapes stay unknown are
counted as such, never as 0. No library counts MACs per precision (onnx-tool and similar count
totals, and not for the contrib ops), hence the small table of formulas below.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable

import numpy as np
import onnx
from pydantic import BaseModel, Field

from optpipe.graph.edit import node_attribute
from optpipe.graph.shapes import ValueTypes, infer_shapes
from optpipe.graph.weight_mix import FLOAT_NAMES, nbits_precision, weight_mix

log = logging.getLogger("optpipe.coverage")

#: Ops that compute in integers whatever their neighbours: ORT's QOperator and dynamic forms.
INTEGER_OPS = {
    "ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "QGemm", "QAttention",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QOrderedMatMul", "QOrderedAttention", "DynamicQuantizeLSTM",
}
#: Ops ORT's quantizer turns into int8 (static QDQ or dynamic): the rest stays float whatever it is told.
QUANTIZABLE_OPS = {"Conv", "MatMul", "Gemm", "Attention", "ConvTranspose", "EmbedLayerNormalization", "Gather", "LSTM"}
#: MAC precisions that are integer compute or integer weights (not "float left").
INTEGER_PRECISIONS = {"int8", "int4"}
#: A quantization stage with less than this share of its MACs in int8 warns.
INT8_MAC_SHARE_MIN = 0.5


class FloatCompute(BaseModel):
    """Compute nodes of one op type left in float, and why."""

    op: str
    precision: str = "fp32"
    nodes: int
    mac_share: float = Field(description="share of the graph's MACs these nodes compute")
    reason: str


class Coverage(BaseModel):
    weights: dict[str, float] = Field(description="share of weight elements per precision (int8/fp16/fp32/...)")
    macs: dict[str, float] = Field(description="share of multiply-accumulates per precision")
    total_macs: int = Field(description="MACs of one pass at the shapes given (per sample at batch 1)")
    weight_elements: int
    bytes: dict[str, float] = Field(default_factory=dict, description="share of weight bytes per precision (a 4-bit "
                                    "weight's scales and zero points count with it)")
    weight_bytes: int = Field(0, description="bytes of the weights counted (packed sizes for 4-bit weights)")
    float_compute: list[FloatCompute] = Field(default_factory=list, description="float compute by op type, most MACs first")
    unknown_shapes: int = Field(0, description="compute nodes whose MACs could not be counted (shape unknown)")
    unknown_ops: dict[str, int] = Field(default_factory=dict, description="those nodes by op type")

    def share(self, precision: str, of: str = "macs") -> float:
        return getattr(self, of).get(precision, 0.0)

    def summary(self) -> str:
        """One cell of the report: the MAC mix, largest first; where no MACs were counted, the
        weights' mix, saying so; compute nodes whose MACs are unknown are counted."""
        def mix(shares):  # sorted here: a coverage read back from the cache has its keys in JSON's order
            ranked = sorted(shares.items(), key=lambda kv: (-kv[1], kv[0]))
            return " · ".join(f"{p} {v:.0%}" for p, v in ranked if v >= 0.005)

        if self.total_macs:
            unknown = f" · {self.unknown_shapes} nodes' MACs unknown" if self.unknown_shapes else ""
            return mix(self.macs) + unknown
        if self.unknown_shapes:
            return f"MACs unknown ({self.unknown_shapes} nodes) · weights " + (mix(self.weights) or "-")
        return mix(self.weights) or "-"

    def float_ops_text(self, limit: int = 4) -> str:
        return ", ".join(f"{f.op} in {f.precision} ({f.mac_share:.0%}: {f.reason})" for f in self.float_compute[:limit])


def precision_coverage(model: onnx.ModelProto, dims: dict[str, int] | None = None,
                       excluded: set[str] | frozenset = frozenset()) -> Coverage:
    """The precision mix of `model` (weights may be absent: only their dims are read).

    `dims`: values for the symbolic input dims (unnamed or unlisted ones become 1).
    `excluded`: node names a quantizer was told to keep in float, so the reason can say so.
    """
    graph = model.graph
    compute = [node for node in graph.node if node.op_type in MAC_COUNTERS or node.op_type in ATTENTION_CORES or node.op_type in NO_MAC_FORMULA]
    counted = [node for node in compute if node.op_type not in NO_MAC_FORMULA]
    types = infer_shapes(model, dims or {}, known=lambda found: all(node_macs(n, found) is not None for n in counted))
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {init.name: init for init in graph.initializer}
    constants = _constant_tensors(graph)

    macs: dict[str, int] = defaultdict(int)
    floats: dict[tuple, list] = defaultdict(lambda: [0, 0])
    unknown: dict[str, int] = defaultdict(int)
    for node in compute:
        parts = node_macs(node, types)
        if parts is None:
            unknown[_op_name(node)] += 1
            continue
        for kind, count in parts:
            precision = attention_core_precision(node, types) if kind == "core" else node_precision(node, types, producers)
            macs[precision] += count
            if precision not in INTEGER_PRECISIONS:
                reason = CORE_REASON if kind == "core" else float_reason(node, initializers, constants, producers, excluded)
                entry = floats[(_op_name(node), precision, reason)]
                entry[0] += 1
                entry[1] += count
    total = sum(macs.values())
    weights, sizes = weight_mix(graph, constants)
    return Coverage(
        weights=_shares(weights),
        bytes=_shares(sizes),
        weight_bytes=int(sum(sizes.values())),
        macs=_shares(macs),
        total_macs=int(total),
        weight_elements=int(sum(weights.values())),
        float_compute=sorted(
            (FloatCompute(op=op, precision=p, nodes=n, mac_share=round(m / total, 4) if total else 0.0, reason=r)
             for (op, p, r), (n, m) in floats.items()),
            key=lambda f: -f.mac_share,
        ),
        unknown_shapes=sum(unknown.values()),
        unknown_ops=dict(sorted(unknown.items(), key=lambda kv: -kv[1])),
    )


def quantization_warning(coverage: Coverage) -> str | None:
    """The warning for a quantization stage that left most of its compute in float, naming the op types."""
    integer = sum(coverage.share(p) for p in INTEGER_PRECISIONS)
    if not coverage.total_macs or integer >= INT8_MAC_SHARE_MIN:
        return None
    kinds = "/".join(p for p in sorted(INTEGER_PRECISIONS, reverse=True) if coverage.share(p)) or "int8"
    return (f"only {integer:.0%} of the MACs are {kinds}; left in float: {coverage.float_ops_text()}")


def unknown_shapes_warning(coverage: Coverage) -> str | None:
    """The warning for compute nodes whose MACs could not be counted: the mix shown leaves them out."""
    if not coverage.unknown_shapes:
        return None
    ops = ", ".join(f"{n} {op}" for op, n in coverage.unknown_ops.items())
    left = "the precision mix leaves them out" if coverage.total_macs else "the precision column shows the weights' mix"
    return (f"MACs of {coverage.unknown_shapes} compute nodes not counted (shapes unknown, or no MAC formula for "
            f"the op): {ops}; {left}")


# --- MACs per op type --------------------------------------------------------------------------


def _dims(types: ValueTypes, name: str) -> list[int] | None:
    return types.get(name, (0, None))[1] if name else None


def _conv_macs(weight_index: int) -> Callable:
    """Output elements x (input channels per group x kernel size): W is [M, C/group, k...]."""

    def count(node, types):
        y, w = _dims(types, node.output[0]), _dims(types, node.input[weight_index])
        return int(np.prod(y, dtype=np.int64) * np.prod(w[1:], dtype=np.int64)) if y and w else None

    return count


def _conv_transpose_macs(node, types):
    x, w = _dims(types, node.input[0]), _dims(types, node.input[1])  # W is [C, M/group, k...]
    return int(np.prod(x, dtype=np.int64) * np.prod(w[1:], dtype=np.int64)) if x and w else None


def _matmul_macs(node, types):
    """Output elements x the reduced dim (A's last axis, or its first with transA)."""
    a, y = _dims(types, node.input[0]), _dims(types, node.output[0])
    if not a or not y:
        return None
    k = a[-2] if node_attribute(node, "transA", 0) and len(a) >= 2 else a[-1]
    return int(np.prod(y, dtype=np.int64) * k)


def _qkv_sizes(node, types) -> tuple[list[int], int, int] | None:
    """Attention / QAttention: the input's [batch, sequence, hidden] and the Q (= K) and V widths of
    the packed weight [hidden, q + k + v] (equal thirds unless qkv_hidden_sizes says otherwise)."""
    x, w = _dims(types, node.input[0]), _dims(types, node.input[1])
    if not x or not w or len(x) != 3:
        return None
    sizes = node_attribute(node, "qkv_hidden_sizes", None)
    q, _, v = list(sizes) if sizes else [w[-1] // 3] * 3
    return x, q, v


def _attention_projection_macs(node, types):
    """Attention / QAttention: the packed Q/K/V projection, input [B, S, hidden] x weight [hidden, q+k+v]."""
    x, w = _dims(types, node.input[0]), _dims(types, node.input[1])
    if not x or not w or len(x) != 3:
        return None
    return int(np.prod(x, dtype=np.int64) * w[-1])


def _attention_core_macs(node, types):
    """Attention / QAttention: scores Q.K^T (B x S x S x q) and context P.V (B x S x S x v)."""
    found = _qkv_sizes(node, types)
    if found is None:
        return None
    (batch, seq, _), q, v = found
    return int(batch * seq * seq * (q + v))


def _matmul_nbits_macs(node, types):
    """com.microsoft MatMulNBits: A [..., K] x a 4-bit weight of N columns (attribute N)."""
    a = _dims(types, node.input[0])
    return int(np.prod(a, dtype=np.int64) * node_attribute(node, "N", 0)) if a else None


def _recurrent_macs(node, types):
    """LSTM / GRU / RNN / DynamicQuantizeLSTM: every step multiplies the input by W and the state by R,
    for every direction: sequence x batch x (W's + R's elements), whatever their layout."""
    x, w, r = (_dims(types, node.input[i]) for i in range(3))
    if not x or not w or not r:
        return None
    return int(x[0] * x[1] * (np.prod(w, dtype=np.int64) + np.prod(r, dtype=np.int64)))


def _mha_macs(node, types):
    """com.microsoft MultiHeadAttention / GroupQueryAttention: scores (Q.K) and context (P.V) on
    [B, S, hidden] inputs (already projected: their projections are MatMuls of their own)."""
    q = _dims(types, node.input[0])
    k = _dims(types, node.input[1]) if len(node.input) > 1 else None
    if not q or len(q) != 3:
        return None
    kv_seq = k[1] if k and len(k) == 3 else q[1]
    return int(2 * q[0] * q[1] * kv_seq * q[2])


#: op -> MACs of its GEMM or convolution (one operand a weight, or both dequantized in QDQ form),
#: computed in the node's precision (node_precision).
MAC_COUNTERS: dict[str, Callable] = {
    "Conv": _conv_macs(1), "ConvInteger": _conv_macs(1), "FusedConv": _conv_macs(1), "NhwcConv": _conv_macs(1),
    "QLinearConv": _conv_macs(3), "ConvTranspose": _conv_transpose_macs,
    "MatMul": _matmul_macs, "MatMulInteger": _matmul_macs, "FusedMatMul": _matmul_macs, "QLinearMatMul": _matmul_macs,
    "DynamicQuantizeMatMul": _matmul_macs, "MatMulIntegerToFloat": _matmul_macs,
    "Gemm": _matmul_macs, "FusedGemm": _matmul_macs, "QGemm": _matmul_macs,
    "GemmFastGelu": _matmul_macs, "MatMulNBits": _matmul_nbits_macs,
    "Attention": _attention_projection_macs, "QAttention": _attention_projection_macs,
    "LSTM": _recurrent_macs, "GRU": _recurrent_macs, "RNN": _recurrent_macs, "DynamicQuantizeLSTM": _recurrent_macs,
}
#: Fused attention -> MACs of its scores and context, which multiply two activations: every ORT
#: kernel computes them in float, QAttention's too (only its Q/K/V projection is an int8 GEMM).
ATTENTION_CORES: dict[str, Callable] = {
    "Attention": _attention_core_macs, "QAttention": _attention_core_macs,
    "MultiHeadAttention": _mha_macs, "GroupQueryAttention": _mha_macs,
}
CORE_REASON = "attention scores and context: both operands are activations"
#: Ops with MACs and no formula here (packed, sparse, decoder-cache and ordered attention variants,
#: Einsum): counted as unknown, so the column says so instead of counting them as free.
NO_MAC_FORMULA = {
    "Einsum", "LongformerAttention", "PackedAttention", "PackedMultiHeadAttention", "DecoderAttention",
    "DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention", "SparseAttention", "PagedAttention",
    "QOrderedMatMul", "QOrderedAttention", "QOrderedLongformerAttention",
}


def node_macs(node: onnx.NodeProto, types: ValueTypes) -> list[tuple[str, int]] | None:
    """A compute node's MACs as ("gemm" | "core", count) parts; None where a shape is unknown."""
    if node.op_type in NO_MAC_FORMULA:
        return None
    parts = []
    for kind, counters in (("gemm", MAC_COUNTERS), ("core", ATTENTION_CORES)):
        counter = counters.get(node.op_type)
        if counter is not None:
            count = counter(node, types)
            if count is None:
                return None
            parts.append((kind, count))
    return parts


# --- precision of a node -----------------------------------------------------------------------


def node_precision(node: onnx.NodeProto, types, producers: dict[str, onnx.NodeProto]) -> str:
    """int8 when the node computes on integers: an integer op, or (QDQ form) both its operands
    come out of DequantizeLinear, which ORT and TensorRT fuse into int8 kernels. Else the float
    type of its output."""
    if node.op_type in INTEGER_OPS:
        return "int8"
    if node.op_type == "MatMulNBits":
        # Weight-only quantization: the MACs are counted in the weight's precision (the bytes a decode
        # step streams, which is what bounds its speed); accuracy_level says what the arithmetic runs in
        # (4: activations quantized to int8 on ORT CPU, lower: dequantized to float), kept in the stage info.
        return nbits_precision(node)
    operands = [name for name in node.input[:2] if name]
    if operands and all(_dequantized(name, producers) for name in operands):
        return "int8"
    elem = types.get(node.output[0], (0, None))[0] or types.get(node.input[0], (0, None))[0]
    return FLOAT_NAMES.get(elem, "fp32")


def _dequantized(name: str, producers: dict[str, onnx.NodeProto]) -> bool:
    """The tensor comes out of a DequantizeLinear (through a Transpose/Reshape the quantizer may insert)."""
    node = producers.get(name)
    while node is not None and node.op_type in ("Transpose", "Reshape", "Identity"):
        node = producers.get(node.input[0])
    return node is not None and node.op_type == "DequantizeLinear"


def attention_core_precision(node: onnx.NodeProto, types) -> str:
    """The float type a fused attention's scores and context run in: its output's (QAttention's is float)."""
    return FLOAT_NAMES.get(types.get(node.output[0], (0, None))[0], "fp32")


def float_reason(node, initializers, constants, producers, excluded) -> str:
    """Why a compute node's GEMM or convolution is not int8, as far as the graph tells."""
    if node.name and node.name in excluded:
        return "kept in float (excluded by the recipe or the accuracy guard)"
    if node.domain not in ("", "ai.onnx") and node.op_type not in QUANTIZABLE_OPS:
        return "a fused op ORT's quantizer does not handle"
    if node.op_type not in QUANTIZABLE_OPS:
        return "an op ORT's quantizer does not handle"
    weight = node.input[1] if len(node.input) > 1 else ""
    if node.op_type == "MatMul" and weight not in initializers and weight not in constants and not _dequantized(weight, producers):
        cast = producers.get(weight)
        if cast is not None and cast.op_type == "Cast" and (cast.input[0] in initializers or cast.input[0] in constants):
            # A float16 graph fused on ONNX Runtime's CPU provider (its float16 weights cast to float32 for kernels
            # the CPU lacks): the quantizer sees no constant weight.
            return "its weight is cast from a constant (a float16 graph?): ORT's quantizer reads float32 weights, start from FP32"
        return "both operands are activations (MatMulConstBOnly)"
    return "not quantized"


# --- constants ----------------------------------------------------------------------------------


def _constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    found = {}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    found[node.output[0]] = attr.t
    return found


def _shares(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    if not total:
        return {}
    return dict(sorted(((k, round(v / total, 4)) for k, v in counts.items() if v), key=lambda kv: -kv[1]))



def _op_name(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
