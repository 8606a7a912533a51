"""What precision a graph computes in: the share of its weights and of its multiply-accumulates
(MACs) in int8 / fp16 / fp32, and the compute nodes left in float with the reason why.

This is how a stage shows what it changed: an int8 stage that quantized only the final Gemm of
a CNN (because `fuse` had turned every Conv into com.microsoft.FusedConv, which ORT's quantizer
does not know) shows "int8 1% of MACs" instead of a bare "ok".

MACs are counted from tensor shapes. Shapes come from ONNX Runtime's symbolic shape inference
(it knows the com.microsoft ops: FusedConv, Attention, QAttention, ...), falling back to ONNX's
own shape inference; symbolic input dims are first fixed to the values given (the recipe's `opt`).
Neither library counts MACs (onnx-tool and similar do, but not for the contrib ops and not per
precision), hence the small table of formulas below.
"""
from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto
from pydantic import BaseModel, Field

from optpipe.graph.edit import node_attribute

log = logging.getLogger("optpipe.coverage")

#: Ops that compute in integers whatever their neighbours: ORT's QOperator and dynamic forms.
INTEGER_OPS = {
    "ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "QGemm", "QAttention",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QOrderedMatMul", "QOrderedAttention",
}
#: Ops ORT's quantizer turns into int8 (static QDQ or dynamic): the rest stays float whatever it is told.
QUANTIZABLE_OPS = {"Conv", "MatMul", "Gemm", "Attention", "ConvTranspose", "EmbedLayerNormalization", "Gather", "LSTM"}
INT8_DTYPES = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4, TensorProto.INT32}
FLOAT_NAMES = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.DOUBLE: "fp64"}
#: Initializers smaller than this are scales, zero points and shapes, not weights.
MIN_WEIGHT_ELEMENTS = 16
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
    float_compute: list[FloatCompute] = Field(default_factory=list, description="float compute by op type, most MACs first")
    unknown_shapes: int = Field(0, description="compute nodes whose MACs could not be counted (shape unknown)")

    def share(self, precision: str, of: str = "macs") -> float:
        return getattr(self, of).get(precision, 0.0)

    def summary(self) -> str:
        """One cell of the report: the MAC mix, largest first (the weights where no MACs were counted)."""
        mix = self.macs if self.total_macs else self.weights
        return " · ".join(f"{p} {v:.0%}" for p, v in mix.items() if v >= 0.005) or "-"

    def float_ops_text(self, limit: int = 4) -> str:
        return ", ".join(f"{f.op} in {f.precision} ({f.mac_share:.0%}: {f.reason})" for f in self.float_compute[:limit])


def precision_coverage(model: onnx.ModelProto, dims: dict[str, int] | None = None,
                       excluded: set[str] | frozenset = frozenset()) -> Coverage:
    """The precision mix of `model` (weights may be absent: only their dims are read).

    `dims`: values for the symbolic input dims (unnamed or unlisted ones become 1).
    `excluded`: node names a quantizer was told to keep in float, so the reason can say so.
    """
    types = _value_types(infer_shapes(model, dims or {}))
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {init.name: init for init in graph.initializer}
    constants = _constant_tensors(graph)

    macs: dict[str, int] = defaultdict(int)
    floats: dict[str, list] = defaultdict(lambda: [0, 0, ""])
    unknown = 0
    for node in graph.node:
        counter = MAC_COUNTERS.get(node.op_type)
        if counter is None:
            continue
        count = counter(node, types)
        if count is None:
            unknown += 1
            continue
        precision = node_precision(node, types, producers)
        macs[precision] += count
        if precision != "int8":
            entry = floats[(_op_name(node), precision)]
            entry[0] += 1
            entry[1] += count
            entry[2] = entry[2] or float_reason(node, initializers, constants, producers, excluded)
    total = sum(macs.values())
    weights = weight_mix(graph, constants)
    return Coverage(
        weights=_shares(weights),
        macs=_shares(macs),
        total_macs=int(total),
        weight_elements=int(sum(weights.values())),
        float_compute=sorted(
            (FloatCompute(op=op, precision=p, nodes=n, mac_share=round(m / total, 4) if total else 0.0, reason=r)
             for (op, p), (n, m, r) in floats.items()),
            key=lambda f: -f.mac_share,
        ),
        unknown_shapes=unknown,
    )


def quantization_warning(coverage: Coverage) -> str | None:
    """The warning for a quantization stage that left most of its compute in float, naming the op types."""
    if not coverage.total_macs or coverage.share("int8") >= INT8_MAC_SHARE_MIN:
        return None
    return (f"only {coverage.share('int8'):.0%} of the MACs are int8; left in float: {coverage.float_ops_text()}")


# --- shapes ------------------------------------------------------------------------------------


def infer_shapes(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """A copy of `model` with fixed input dims and every shape inference could find."""
    fixed = copy.deepcopy(model)
    for value in fixed.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value"):
                dim.dim_value = int(dims.get(dim.dim_param, 1))
    del fixed.graph.value_info[:]  # stale value_info from earlier passes would contradict the new dims
    for node in fixed.graph.node:
        _as_standard_twin(node)
    # ONNX's C++ inference first (a ResNet-50 in well under a second); ORT's symbolic inference,
    # pure Python and ~10x slower, only where a compute node's shapes are still unknown.
    try:
        inferred = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
        if _compute_shapes_known(inferred):
            return inferred
    except Exception as exc:
        log.debug("onnx shape inference failed (%s); trying ORT's symbolic shape inference", exc)
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inferred = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True, guess_output_rank=True)
        if inferred is not None:
            return inferred
    except Exception as exc:  # it gives up on some graphs (missing weights for a shape constant, ...)
        log.debug("symbolic shape inference failed (%s); MACs of unknown shapes are not counted", exc)
    return fixed


def _compute_shapes_known(model: onnx.ModelProto) -> bool:
    types = _value_types(model)
    return all(MAC_COUNTERS[n.op_type](n, types) is not None for n in model.graph.node if n.op_type in MAC_COUNTERS)


#: Fused ops neither shape inference knows, and the standard op with the same output shape.
#: Their activation attributes are dropped: only the shapes of this copy are used.
STANDARD_TWINS = {"FusedConv": ("Conv", {"activation", "activation_params"}),
                  "FusedGemm": ("Gemm", {"activation", "activation_alpha", "activation_beta", "activation_gamma"})}


def _as_standard_twin(node: onnx.NodeProto) -> None:
    twin = STANDARD_TWINS.get(node.op_type) if node.domain == "com.microsoft" else None
    if twin is None:
        return
    op, dropped = twin
    kept = [attr for attr in node.attribute if attr.name not in dropped]
    node.op_type, node.domain = op, ""
    del node.attribute[:]
    node.attribute.extend(kept)
    del node.input[3:]  # FusedConv's optional Z (added before the activation) has the output's shape


def _value_types(model: onnx.ModelProto) -> dict[str, tuple[int, Optional[list[int]]]]:
    """Tensor name -> (element type, concrete dims or None where any dim is unknown)."""
    found = {}
    graph = model.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim] if tensor.HasField("shape") else None
        found[value.name] = (tensor.elem_type, None if dims is None or None in dims else dims)
    for init in graph.initializer:
        found[init.name] = (init.data_type, list(init.dims))
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    found[node.output[0]] = (attr.t.data_type, list(attr.t.dims))
    return found


def _dims(types, name: str) -> list[int] | None:
    return types.get(name, (0, None))[1] if name else None


# --- MACs per op type --------------------------------------------------------------------------


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
    """Output elements x the reduced dim (A's last axis)."""
    a, y = _dims(types, node.input[0]), _dims(types, node.output[0])
    if not a or not y:
        return None
    k = a[-2] if node_attribute(node, "transA", 0) and len(a) >= 2 else a[-1]
    return int(np.prod(y, dtype=np.int64) * k)


def _attention_macs(node, types):
    """com.microsoft Attention / QAttention: the packed Q/K/V projection plus scores and context."""
    x, w = _dims(types, node.input[0]), _dims(types, node.input[1])
    if not x or not w or len(x) != 3:
        return None
    batch, seq, hidden = x
    return int(batch * seq * hidden * w[-1] + 2 * batch * seq * seq * hidden)


def _mha_macs(node, types):
    """com.microsoft MultiHeadAttention: scores (Q.K) and context (P.V) on [B, S, hidden] inputs."""
    q = _dims(types, node.input[0])
    k = _dims(types, node.input[1]) if len(node.input) > 1 else None
    if not q or len(q) != 3:
        return None
    kv_seq = k[1] if k and len(k) == 3 else q[1]
    return int(2 * q[0] * q[1] * kv_seq * q[2])


MAC_COUNTERS: dict[str, Callable] = {
    "Conv": _conv_macs(1), "ConvInteger": _conv_macs(1), "FusedConv": _conv_macs(1), "NhwcConv": _conv_macs(1),
    "QLinearConv": _conv_macs(3), "ConvTranspose": _conv_transpose_macs,
    "MatMul": _matmul_macs, "MatMulInteger": _matmul_macs, "FusedMatMul": _matmul_macs, "QLinearMatMul": _matmul_macs,
    "DynamicQuantizeMatMul": _matmul_macs, "MatMulIntegerToFloat": _matmul_macs,
    "Gemm": _matmul_macs, "FusedGemm": _matmul_macs, "QGemm": _matmul_macs,
    "Attention": _attention_macs, "QAttention": _attention_macs,
    "MultiHeadAttention": _mha_macs, "GroupQueryAttention": _mha_macs,
}


# --- precision of a node -----------------------------------------------------------------------


def node_precision(node: onnx.NodeProto, types, producers: dict[str, onnx.NodeProto]) -> str:
    """int8 when the node computes on integers: an integer op, or (QDQ form) both its operands
    come out of DequantizeLinear, which ORT and TensorRT fuse into int8 kernels. Else the float
    type of its output."""
    if node.op_type in INTEGER_OPS:
        return "int8"
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


def float_reason(node, initializers, constants, producers, excluded) -> str:
    """Why a compute node is not int8, as far as the graph tells."""
    if node.name and node.name in excluded:
        return "kept in float (excluded by the recipe or the accuracy guard)"
    if node.op_type in ("MultiHeadAttention", "GroupQueryAttention"):
        return "attention scores and context: both operands are activations"
    if node.domain not in ("", "ai.onnx") and node.op_type not in QUANTIZABLE_OPS:
        return "a fused op ORT's quantizer does not handle"
    if node.op_type not in QUANTIZABLE_OPS:
        return "an op ORT's quantizer does not handle"
    weight = node.input[1] if len(node.input) > 1 else ""
    if node.op_type == "MatMul" and weight not in initializers and weight not in constants and not _dequantized(weight, producers):
        return "both operands are activations (MatMulConstBOnly)"
    return "not quantized"


# --- weights -----------------------------------------------------------------------------------


def weight_mix(graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]) -> dict[str, int]:
    """Weight elements per precision; small tensors (scales, zero points, shapes) do not count."""
    counts: dict[str, int] = defaultdict(int)
    for tensor in [*graph.initializer, *constants.values()]:
        size = int(np.prod(tensor.dims, dtype=np.int64))
        if size < MIN_WEIGHT_ELEMENTS:
            continue
        if tensor.data_type in INT8_DTYPES - {TensorProto.INT32}:
            counts["int8"] += size
        elif tensor.data_type == TensorProto.INT32:
            continue  # quantized biases: part of an int8 op, too small to matter
        elif tensor.data_type in FLOAT_NAMES:
            counts[FLOAT_NAMES[tensor.data_type]] += size
    return counts


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
