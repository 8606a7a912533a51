"""weight_only: INT4 / INT8 weight-only quantization of MatMul weights for ONNX Runtime (MatMulNBits).

ONNX Runtime's own quantizer (`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`)
replaces each MatMul with a constant weight by `com.microsoft.MatMulNBits`: the weight stored in 4
or 8 bits in blocks of `block_size` along K, one scale (and, asymmetric, one zero point) per block.
Activations stay in float; `accuracy_level` chooses what the kernel computes in (ORT CPU: 4 quantizes
the activations to int8 per block and runs integer dot products, which is what makes decode fast on
VNNI/AMX CPUs; 0/1 dequantize the weight to float). This is the form ONNX Runtime GenAI runs.

A Gemm with a constant weight (the dynamo exporter's `torch.addmm`: GPT-2's Conv1D) is first rewritten as
MatMul + Add, and a MatMul reading a Transpose of an initializer (a tied LM head: the embedding table) gets the
transposed table as its own initializer (optpipe/graph/matmul_weights.py): the forms the quantizer takes. The
info lists them; `exclude` keeps a head in float, untouched.

Nothing is calibrated (round-to-nearest per block, or HQQ's optimized scales): the stage's accuracy
is what the evaluation measures against the reference, and the stage info lists what was quantized
and what was left in float and why.
"""
from __future__ import annotations

from typing import Literal

import onnx
from pydantic import Field, field_validator, model_validator

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.core.errors import PassError, first_line
from optpipe.graph.coverage import precision_coverage, quantization_warning
from optpipe.graph.matmul_weights import gemms_as_matmuls, transposed_weights_folded
from optpipe.graph.stats import graph_stats, op_changes, op_histogram
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams
from optpipe.passes._library_logs import root_logs_to, warnings_only


class WeightOnlyParams(PassParams):
    bits: Literal[4, 8] = Field(4, description="bits per weight (MatMulNBits)")
    block_size: int = Field(32, ge=16, le=256, description="weights per scale along K (a power of two, 16-256)")
    symmetric: bool = Field(True, description="symmetric blocks (no zero points); false: asymmetric (a zero point per block)")
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        4, description="MatMulNBits compute type: 4 = int8 activations (fast on ORT CPU), 1 = fp32, 0 = the kernel's default"
    )
    algorithm: Literal["default", "hqq"] = Field(
        "default", description="default: round-to-nearest per block; hqq: Half-Quadratic Quantization's optimized scales "
        "(4 bits, asymmetric)")
    gather: bool = Field(False, description="also quantize embedding tables (Gather -> GatherBlockQuantized): smaller, not faster")
    exclude: list[str] = Field(default_factory=list, description="node names kept in float (e.g. the LM head)")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two (16, 32, 64, 128 or 256), not {value}")
        return value

    @model_validator(mode="after")
    def _algorithm_fits(self):
        """HQQ's one form in ORT, refused otherwise at recipe read (exit 2), not when the stage runs."""
        if self.algorithm == "hqq" and (self.bits != 4 or self.symmetric):
            raise ValueError("algorithm hqq quantizes to 4 bits, asymmetric: set `bits: 4` and `symmetric: false`, "
                             "or `algorithm: default`")
        return self


class WeightOnlyPass(Pass[WeightOnlyParams]):
    """Quantize MatMul weights to INT4/INT8 (ORT MatMulNBits, weight-only, blockwise); activations stay float."""

    name = "weight_only"
    version = "2"  # 2: Gemm weights and a tied LM head (through a Transpose) quantized too (graph/matmul_weights.py)
    Params = WeightOnlyParams
    libraries = ("onnx", "onnxruntime", "onnxruntime-gpu")

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        source = model.load()
        _check_names(source, params.exclude)
        before = op_histogram(source)
        # ORT's quantizer takes a MatMul of an initializer only (optpipe/graph/matmul_weights.py).
        gemms = gemms_as_matmuls(source)
        tied = transposed_weights_folded(source, skip=frozenset(params.exclude))
        candidates, skipped = weight_matmuls(source, params.exclude)
        if not candidates:
            raise PassError("no MatMul or Gemm with a constant 2-D weight to quantize (weight_only needs their weights as "
                            "initializers); hang the stage after export or simplify")
        quantized = quantize(source, params, ctx)
        del source  # the float weights: only the quantized model stays in memory from here
        artifact = save_model(quantized, ctx.workdir)
        del quantized
        graph = artifact.load(with_weights=False)
        dims = {name: dim.opt for name, dim in ctx.inputs.dims.items()}
        coverage = precision_coverage(graph, dims, excluded=set(params.exclude))
        warning = quantization_warning(coverage)
        if warning:
            ctx.log.warning("weight_only: %s", warning)
        stats = graph_stats(graph)
        info = {
            "format": "com.microsoft.MatMulNBits (ONNX Runtime)",
            "bits": params.bits,
            "block_size": params.block_size,
            "symmetric": params.symmetric,
            "accuracy_level": params.accuracy_level,
            "compute": "int8 activations x int%d weights" % params.bits if params.accuracy_level == 4 else "float (weights dequantized)",
            "algorithm": params.algorithm,
            "quantized": sum(n.op_type in ("MatMulNBits", "GatherBlockQuantized") for n in graph.graph.node),
            "candidates": len(candidates),
            "gemms_as_matmuls": gemms,
            "transposed_weights": tied,  # a tied LM head, read through a Transpose of the embedding table
            "left_in_float": skipped,
            "excluded": params.exclude,
            "op_changes": op_changes(before, stats["ops"]),
            "coverage": coverage.model_dump(mode="json"),
            "size_bytes": artifact.size_bytes(),
            "graph": stats,
        }
        return write_info(ctx.workdir, info)


def quantize(source: onnx.ModelProto, params: WeightOnlyParams, ctx: PassContext) -> onnx.ModelProto:
    """ORT's MatMulNBitsQuantizer on the loaded model (it edits the proto in place: `source` is spent)."""
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
        with root_logs_to(ctx.log), warnings_only(mnb.logger):
            quantizer = mnb.MatMulNBitsQuantizer(
                source, bits=params.bits, block_size=params.block_size, is_symmetric=params.symmetric,
                accuracy_level=params.accuracy_level, nodes_to_exclude=list(params.exclude), algo_config=config,
            )
            quantizer.process()
    except Exception as exc:  # ORT's quantizer raises assorted errors on graphs it cannot handle
        ctx.log.exception("weight-only quantization failed")
        raise PassError(f"ONNX Runtime's MatMulNBits quantizer failed: {first_line(exc)}; "
                        "try another `block_size`, or `exclude` the node it names") from None
    result = quantizer.model.model
    if params.algorithm == "hqq":
        _set_accuracy_level(result, params.accuracy_level)  # HQQ's config has no accuracy level of its own
    return result


def weight_matmuls(model: onnx.ModelProto, excluded: list[str]) -> tuple[list[str], list[dict]]:
    """MatMul nodes with a constant 2-D weight (what MatMulNBits takes), and the others with why."""
    initializers = {init.name: init for init in model.graph.initializer}
    taken, skipped = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        weight = initializers.get(node.input[1])
        if node.name in excluded:
            skipped.append({"node": node.name, "reason": "listed in exclude"})
        elif weight is None:
            skipped.append({"node": node.name, "reason": "both operands are activations (attention scores / context)"})
        elif len(weight.dims) != 2:
            skipped.append({"node": node.name, "reason": f"weight of rank {len(weight.dims)} (MatMulNBits takes 2-D)"})
        else:
            taken.append(node.name)
    return taken, skipped[:50]


def _set_accuracy_level(model: onnx.ModelProto, level: int) -> None:
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))


def _check_names(model: onnx.ModelProto, names: list[str]) -> None:
    known = {node.name for node in model.graph.node}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PassError(f"exclude names nodes the model does not have: {unknown[:5]}; use node names from the input model")
