"""The precision mix of an OpenVINO IR with compressed weights, as a Coverage (the report's column).

NNCF's weight compression stores a MatMul's weight as a u4/i4/u8/i8 Constant followed by
Convert -> (Subtract zero point) -> Multiply scale (-> Reshape): the weight's precision is the
element type of the Constant at the head of that chain. A MatMul's MACs per token are its weight's
K x N, so the MAC mix is the mix of MatMul weight elements (per token: OpenVINO's IR has no fixed
sequence length to count at); embeddings (Gather) count in the weights and bytes, not in MACs.
OpenVINO has no API that reports weight precisions per layer before compiling, hence this walk.
"""
from __future__ import annotations

from collections import defaultdict

from optpipe.graph.coverage import Coverage, FloatCompute, _shares

#: OpenVINO element type names -> the report's precision names.
PRECISIONS = {"u4": "int4", "i4": "int4", "u8": "int8", "i8": "int8", "f32": "fp32", "f16": "fp16", "bf16": "bf16",
              "nf4": "nf4", "f8e4m3": "fp8", "f4e2m1": "fp4"}
BITS = {"int4": 4, "nf4": 4, "fp4": 4, "int8": 8, "fp8": 8, "fp16": 16, "bf16": 16, "fp32": 32}
#: Ops between a compressed weight Constant and its consumer.
DECOMPRESSION = {"Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze"}
WEIGHT_USERS = {"MatMul": True, "Gather": False, "Convolution": True}  # op -> counts MACs
MIN_ELEMENTS = 16


def ir_coverage(ov_model) -> Coverage:
    elements: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    macs: dict[str, int] = defaultdict(int)
    float_layers: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    seen: set[str] = set()
    for op in ov_model.get_ordered_ops():
        kind = op.get_type_name()
        if kind not in WEIGHT_USERS:
            continue
        index = 0 if kind == "Gather" else 1
        constant = _weight_constant(op.input_value(index).get_node())
        if constant is None or constant.get_friendly_name() in seen:
            continue
        seen.add(constant.get_friendly_name())
        count = 1
        for d in constant.get_output_shape(0):
            count *= int(d)
        if count < MIN_ELEMENTS:
            continue
        precision = PRECISIONS.get(constant.get_element_type().get_type_name(), constant.get_element_type().get_type_name())
        elements[precision] += count
        sizes[precision] += count * BITS.get(precision, 32) // 8
        if WEIGHT_USERS[kind]:
            macs[precision] += count
            if precision in ("fp32", "fp16", "bf16"):
                entry = float_layers[kind]
                entry[0] += 1
                entry[1] += count
    total = sum(macs.values())
    return Coverage(
        weights=_shares(elements), macs=_shares(macs), total_macs=int(total), weight_elements=int(sum(elements.values())),
        bytes=_shares(sizes), weight_bytes=int(sum(sizes.values())),
        float_compute=[FloatCompute(op=op, nodes=n, mac_share=round(m / total, 4) if total else 0.0,
                                    reason="weight left in float (NNCF ignored scope or backup mode)")
                       for op, (n, m) in float_layers.items()],
    )


def _weight_constant(node):
    """The Constant at the head of a weight's decompression chain, or None (an activation)."""
    while node.get_type_name() in DECOMPRESSION:
        node = node.input_value(0).get_node()
    return node if node.get_type_name() == "Constant" else None
