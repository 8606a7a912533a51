"""Make a graph fit for ONNX Runtime's quantizer without changing what it computes.

Two things in graphs from earlier passes break or blind the quantizer:

- value_info entries for initializers. onnxscript's fusion (through onnx-ir) writes one for
  every weight. Dynamic quantization turns each Gemm into MatMul + Add and transposes its
  weight in place (`replace_gemm_with_matmul`), so the weight's value_info goes stale and ONNX
  shape inference stops with "Inferred shape and existing shape differ in dimension 0:
  (32) vs (3)" (hidden 32, 3 classes: a classifier head). An initializer's shape is its own
  dims; the duplicate is dropped.
- com.microsoft FusedConv / FusedGemm, which the quantizer does not know: split back
  (optpipe.graph.unfuse).
"""
from __future__ import annotations

import onnx

from optpipe.graph.unfuse import has_fused_ops, unfuse


#: The opset ORT's quantizer writes per-channel QDQ at (DequantizeLinear's `axis` is opset 13's). Below it, the
#: quantizer wrote that attribute into an opset-9 model, which ONNX Runtime then refused ("internal error").
QDQ_OPSET = 13


def needs_preparation(model: onnx.ModelProto) -> bool:
    """Read with or without weights: only names, node types and the opset are looked at."""
    return bool(shadowing_value_info(model)) or has_fused_ops(model) or standard_opset(model) < QDQ_OPSET


def prepare_for_quantizer(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` the quantizer can read, and what was changed."""
    shadowed = shadowing_value_info(model)
    opset = standard_opset(model)
    if opset < QDQ_OPSET:
        # onnx's own converter (each op's adapter between versions), not an edit of the opset number
        model = onnx.version_converter.convert_version(model, QDQ_OPSET)
    prepared, split = unfuse(model)
    if shadowed:
        kept = [v for v in prepared.graph.value_info if v.name not in shadowed]
        del prepared.graph.value_info[:]
        prepared.graph.value_info.extend(kept)
    changes = {"split_fused_ops": split, "dropped_initializer_value_info": len(shadowed)}
    return prepared, changes | ({"opset": f"{opset} -> {QDQ_OPSET} (onnx.version_converter)"} if opset < QDQ_OPSET else {})


def standard_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), QDQ_OPSET)


def shadowing_value_info(model: onnx.ModelProto) -> set[str]:
    initializers = {init.name for init in model.graph.initializer}
    return {v.name for v in model.graph.value_info if v.name in initializers}
