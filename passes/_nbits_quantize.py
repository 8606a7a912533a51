"""weight_only's quantization of a loaded model (passes/weight_only.py is the pass): Gemm weights and tied heads
brought to the forms ORT's MatMulNBitsQuantizer takes, the quantizer's call, and what was done. Its own module so
that the pass's worker (passes/_weight_only_on_disk.py) runs the very same functions on a model whose weights are
still on disk; `params` is the pass's WeightOnlyParams, or in the worker the same fields as a namespace.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from optpipe.core.errors import PassError, first_line
from optpipe.graph.matmul_weights import gemms_as_matmuls, tied_heads, transposed_weights_folded
from optpipe.passes._library_logs import root_logs_to, warnings_only
from optpipe.passes._tied_head_nbits import STREAMED_DTYPES, quantize_tied_heads

if TYPE_CHECKING:
    from optpipe.passes.weight_only import WeightOnlyParams


def quantize_weights(source: onnx.ModelProto, params: WeightOnlyParams, log: logging.Logger, folder: Path,
                     required: bool = True) -> tuple[onnx.ModelProto, dict]:
    """`source` quantized (it is spent) and what was done. Its large weights may still be external data in
    `folder` (the worker's case): ORT's quantizer and the tied heads read them from there, one at a time.
    Without a MatMul to quantize: a PassError where `required`, else `source` back (AWQ's leftovers)."""
    check_names(source, params.exclude)
    # ORT's quantizer takes a MatMul of an initializer only (optpipe/graph/matmul_weights.py).
    gemms = gemms_as_matmuls(source)
    heads = tied_heads(source, skip=frozenset(params.exclude))
    streamed = params.algorithm == "default" and all(table.data_type in STREAMED_DTYPES for _, _, table in heads)
    if not streamed:
        transposed_weights_folded(source, skip=frozenset(params.exclude))
    candidates, skipped = weight_matmuls(source, params.exclude, {node.name for node, _, _ in heads} if streamed else set())
    if not candidates and not required:
        return source, {"candidates": 0, "gemms_as_matmuls": gemms, "transposed_weights": [], "left_in_float": skipped}
    if not candidates:
        raise PassError("no MatMul or Gemm with a constant 2-D weight to quantize (weight_only needs their weights as "
                        "initializers); hang the stage after export or simplify")
    quantized, config = quantize(source, params, log)
    if streamed and heads:
        try:
            # found again: ORT's quantizer rebuilt the node lists, so the protos found before it are not the graph's
            quantize_tied_heads(quantized, tied_heads(quantized, skip=frozenset(params.exclude)), config, folder)
        except (ValueError, RuntimeError, OSError) as exc:  # an unreadable table, or ORT's kernel refusing its shape
            raise PassError(f"quantizing the tied LM head failed: {first_line(exc)}; keep it in float with "
                            f"`exclude: {[node.name for node, _, _ in heads]}`") from None
    return quantized, {"candidates": len(candidates), "gemms_as_matmuls": gemms,
                       "transposed_weights": [node.name for node, _, _ in heads], "left_in_float": skipped}


def quantize(source: onnx.ModelProto, params: WeightOnlyParams, log: logging.Logger):
    """ORT's MatMulNBitsQuantizer on the loaded model (it edits the proto in place: `source` is spent); the
    quantized model and the quantizer's config."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnb
    from onnxruntime.quantization.quant_utils import QuantFormat

    op_types = ("MatMul", "Gather") if params.gather else ("MatMul",)
    if params.algorithm == "hqq":
        config = mnb.HQQWeightOnlyQuantConfig(block_size=params.block_size, bits=params.bits, op_types_to_quantize=op_types)
    else:
        config = mnb.DefaultWeightOnlyQuantConfig(
            block_size=params.block_size, is_symmetric=params.symmetric, accuracy_level=params.accuracy_level,
            quant_format=QuantFormat.QOperator, op_types_to_quantize=op_types, bits=params.bits,
        )
    try:
        with root_logs_to(log), warnings_only(mnb.logger):
            quantizer = mnb.MatMulNBitsQuantizer(
                source, bits=params.bits, block_size=params.block_size, is_symmetric=params.symmetric,
                accuracy_level=params.accuracy_level, nodes_to_exclude=list(params.exclude), algo_config=config,
            )
            quantizer.process()
    except Exception as exc:  # ORT's quantizer raises assorted errors on graphs it cannot handle
        log.exception("weight-only quantization failed")
        raise PassError(f"ONNX Runtime's MatMulNBits quantizer failed: {first_line(exc)}; "
                        "try another `block_size`, or `exclude` the node it names") from None
    result = quantizer.model.model
    if params.algorithm == "hqq":
        set_accuracy_level(result, params.accuracy_level)  # HQQ's config has no accuracy level of its own
    return result, config


def weight_matmuls(model: onnx.ModelProto, excluded: list[str], heads: set[str] = frozenset()) -> tuple[list[str], list[dict]]:
    """MatMul nodes with a constant 2-D weight (what MatMulNBits takes), with the tied `heads` quantized in
    slices, and the others with why."""
    initializers = {init.name: init for init in model.graph.initializer}
    taken, skipped = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        weight = initializers.get(node.input[1])
        if node.name in heads:
            taken.append(node.name)
        elif node.name in excluded:
            skipped.append({"node": node.name, "reason": "listed in exclude"})
        elif weight is None:
            skipped.append({"node": node.name, "reason": "both operands are activations (attention scores / context)"})
        elif len(weight.dims) != 2:
            skipped.append({"node": node.name, "reason": f"weight of rank {len(weight.dims)} (MatMulNBits takes 2-D)"})
        else:
            taken.append(node.name)
    return taken, skipped[:50]


def set_accuracy_level(model: onnx.ModelProto, level: int) -> None:
    """Every MatMulNBits computes at `level`: the attribute set where a writer gave another, added where it gave none."""
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attribute = next((a for a in node.attribute if a.name == "accuracy_level"), None)
        if attribute is None:
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
        else:
            attribute.i = level


def check_names(model: onnx.ModelProto, names: list[str]) -> None:
    known = {node.name for node in model.graph.node}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PassError(f"exclude names nodes the model does not have: {unknown[:5]}; use node names from the input model")
