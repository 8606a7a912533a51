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


def needs_preparation(model: onnx.ModelProto) -> bool:
    """Read with or without weights: only names and node types are looked at."""
    return bool(shadowing_value_info(model)) or has_fused_ops(model)


def prepare_for_quantizer(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` the quantizer can read, and what was changed."""
    shadowed = shadowing_value_info(model)
    prepared, split = unfuse(model)
    if shadowed:
        kept = [v for v in prepared.graph.value_info if v.name not in shadowed]
        del prepared.graph.value_info[:]
        prepared.graph.value_info.extend(kept)
    return prepared, {"split_fused_ops": split, "dropped_initializer_value_info": len(shadowed)}


def shadowing_value_info(model: onnx.ModelProto) -> set[str]:
    initializers = {init.name for init in model.graph.initializer}
    return {v.name for v in model.graph.value_info if v.name in initializers}
