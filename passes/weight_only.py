"""weight_only: INT4 / INT8 weight-only quantization of MatMul weights for ONNX Runtime (MatMulNBits).

ONNX Runtime's own quantizer (`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`)
replaces each MatMul with a constant weight by `com.microsoft.MatMulNBits`: the weight stored in 4
or 8 bits in blocks of `block_size` along K, one scale (and, asymmetric, one zero point) per block.
Activations stay in float; `accuracy_level` chooses what the kernel computes in (ORT CPU: 4 quantizes
the activations to int8 per block and runs integer dot products, which is what makes decode fast on
VNNI/AMX CPUs; 0/1 dequantize the weight to float). This is the form ONNX Runtime GenAI runs.

A Gemm with a constant weight (the dynamo exporter's `torch.addmm`: GPT-2's Conv1D) is first rewritten as
MatMul + Add (optpipe/graph/matmul_weights.py), the form the quantizer takes. A MatMul reading a Transpose of an
initializer (a tied LM head: the embedding table) is quantized from the table's rows, a slice at a time, into the
MatMulNBits ORT's quantizer would write for the transposed table (passes/_tied_head_nbits.py; HQQ, which takes a
whole weight, gets the transposed table as a float initializer first). The info lists them; `exclude` keeps a
head in float, untouched.

From 256 MB of weights the quantizer runs in a worker that reads each weight from disk when it quantizes it
(passes/_weight_only_on_disk.py; Gemma 3 270M's passes 3.2-3.4 -> 0.85-1.18 GB in a compile, docs/memory.md).

Nothing is calibrated by the default algorithm (round-to-nearest per block) or HQQ (optimized scales). `algorithm:
awq` is the data-aware one: NNCF's activation-aware INT4 on data.calibration, its statistics run by ONNX Runtime,
`ratio` of the MatMuls in INT4 and the rest at 8 bits (passes/_nncf_awq.py; ORT's own GPTQ returns round-to-nearest,
docs/llm.md). The stage's accuracy is what the evaluation measures against the reference, and the stage info lists
what was quantized and what was left in float and why.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Literal

from pydantic import Field, field_validator, model_validator

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.core.errors import PassError
from optpipe.graph.coverage import precision_coverage, quantization_warning
from optpipe.graph.stats import graph_stats, op_changes, op_histogram
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams
from optpipe.passes import _weight_only_on_disk
from optpipe.passes._nbits_quantize import quantize_weights


class WeightOnlyParams(PassParams):
    bits: Literal[4, 8] = Field(4, description="bits per weight (MatMulNBits)")
    block_size: int = Field(32, ge=16, le=256, description="weights per scale along K (a power of two, 16-256)")
    symmetric: bool = Field(True, description="symmetric blocks (no zero points); false: asymmetric (a zero point per block)")
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        4, description="MatMulNBits compute type: 4 = int8 activations (fast on ORT CPU), 1 = fp32, 0 = the kernel's default"
    )
    algorithm: Literal["default", "hqq", "awq"] = Field(
        "default", description="default: round-to-nearest per block; hqq: Half-Quadratic Quantization's optimized scales "
        "(4 bits, asymmetric); awq: NNCF's activation-aware INT4 on data.calibration (4 bits, symmetric; the MatMuls it "
        "leaves and the LM head at 8 bits)")
    ratio: float = Field(1.0, gt=0, le=1, description="awq: share of the MatMuls' weights in INT4, whole layers (NNCF ranks "
                         "them by their activations' sensitivity), the rest at 8 bits")
    scale_estimation: bool = Field(False, description="awq: NNCF's scale estimation after AWQ (each block's scale fitted "
                                   "to its layer's output on the calibration data)")
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
        if self.algorithm == "awq" and (self.bits != 4 or not self.symmetric):
            # passes/_nncf_awq.py: NNCF 3.4 writes asymmetric INT4 zero points that ONNX Runtime 1.31 refuses to load.
            raise ValueError("algorithm awq quantizes to 4 bits, symmetric (NNCF's asymmetric zero points do not load "
                             "in ONNX Runtime): set `bits: 4` and `symmetric: true`, or `algorithm: default`")
        if self.algorithm != "awq" and (self.ratio != 1 or self.scale_estimation):
            raise ValueError("`ratio` and `scale_estimation` are options of `algorithm: awq`: set it, or remove them")
        return self


class WeightOnlyPass(Pass[WeightOnlyParams]):
    """Quantize MatMul weights to INT4/INT8 (ORT MatMulNBits, weight-only, blockwise); activations stay float."""

    name = "weight_only"
    version = "3"  # 2: Gemm weights and a tied LM head (through a Transpose) quantized too (graph/matmul_weights.py)
    # 3: an unnamed Gemm's MatMul + Add named after its output (two unnamed Gemms made a graph ORT refused)
    Params = WeightOnlyParams
    libraries = ("onnx", "onnxruntime", "onnxruntime-gpu")
    calibration_use = ("weight_only with algorithm awq", "set `params: {algorithm: default}`")

    @property
    def needs_calibration(self) -> bool:
        return self.params.algorithm == "awq"

    def fingerprint(self, ctx: PassContext) -> dict:
        """awq: NNCF's version, and the CPU class its statistics ran on (ORT's kernels), join the key."""
        if self.params.algorithm != "awq":
            return {}
        from importlib.metadata import version

        from optpipe.hardware.cpu_features import engine_target

        return {"nncf": version("nncf"), "cpu": engine_target("onnxruntime").key()}

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        if params.algorithm == "awq":
            before = op_histogram(model.load(with_weights=False))
            artifact, facts = _awq(model, params, ctx)
        elif model.size_bytes() >= _weight_only_on_disk.WORKER_MIN_BYTES:
            before = op_histogram(model.load(with_weights=False))
            artifact, facts = _on_disk(model, params, ctx)
        else:
            source = model.load()
            before = op_histogram(source)
            quantized, facts = quantize_weights(source, params, ctx.log, model.folder)
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
            "compute": f"int8 activations x {_widths(params)} weights" if params.accuracy_level == 4 else "float (weights dequantized)",
            "algorithm": params.algorithm,
            **({"ratio": params.ratio, "scale_estimation": params.scale_estimation} if params.algorithm == "awq" else {}),
            "quantized": sum(n.op_type in ("MatMulNBits", "GatherBlockQuantized") for n in graph.graph.node),
            **facts,  # candidates, gemms_as_matmuls, transposed_weights (tied LM heads), left_in_float, weights
            "excluded": params.exclude,
            "op_changes": op_changes(before, stats["ops"]),
            "coverage": coverage.model_dump(mode="json"),
            "size_bytes": artifact.size_bytes(),
            "graph": stats,
        }
        return write_info(ctx.workdir, info)


def _widths(params: WeightOnlyParams) -> str:
    return "int4 and int8" if params.algorithm == "awq" else f"int{params.bits}"


def _on_disk(model: ModelArtifact, params: WeightOnlyParams, ctx: PassContext) -> tuple[ModelArtifact, dict]:
    """The quantized artifact and what was done, from a worker reading the weights from disk."""
    return _in_worker(
        lambda scratch: _weight_only_on_disk.quantize_on_disk(model.path, params.model_dump(mode="json"), ctx.workdir, scratch),
        "ONNX Runtime's MatMulNBits quantizer failed: {}; try another `block_size`, or `exclude` the node it names", ctx)


def _awq(model: ModelArtifact, params: WeightOnlyParams, ctx: PassContext) -> tuple[ModelArtifact, dict]:
    """NNCF's AWQ in its worker (passes/_nncf_awq.py), whatever the model's size: its statistics sessions and graph
    copies are given back when the worker exits."""
    from optpipe.passes import _nncf_awq

    return _in_worker(
        lambda scratch: _nncf_awq.awq_on_disk(model.path, params.model_dump(mode="json"), ctx, scratch),
        "NNCF's AWQ weight compression failed: {}; try another `block_size` or `ratio`, or `algorithm: default`", ctx)


def _in_worker(work: Callable[[Path], dict], failed: str, ctx: PassContext) -> tuple[ModelArtifact, dict]:
    """The artifact a disk worker wrote into the stage's folder (`work` runs it with a scratch folder) and its facts;
    its failure as one line: the pass's own words where the worker raised them, else `failed` with its message."""
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as scratch:
        try:
            facts = work(Path(scratch))
        except _weight_only_on_disk.DiskWorkerFailed as exc:
            if exc.said:  # a refusal the pass worded itself, in the worker
                raise PassError(exc.said) from None
            raise PassError(failed.format(exc)) from None
    return ModelArtifact(folder=ctx.workdir, info={}), {**facts, "weights": "on disk (worker)"}
