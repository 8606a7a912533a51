"""int8: INT8 quantization with ONNX Runtime, static (QDQ, calibrated) or dynamic, with an accuracy guard.

Static mode writes the one format that is both fast on ORT CPU and consumed directly by
TensorRT's explicit quantization: QDQ, signed int8 activations and weights, symmetric
(zero points 0), per-channel weights, no int32 bias Q/DQ (TensorRT has none). Only the
ops that do the arithmetic (MatMul with constant weights, Gemm, Conv) are quantized:
Q/DQ around every op is what made naive static QDQ 5x slower (DESIGN.md).
Dynamic mode quantizes weights ahead of time and activations at run time (ORT CPU only).

Guard: the result is compared with the pass's input on the evaluation set; while it
breaks the stage's tolerance, the node that adds the most error (optpipe.sensitivity)
is kept in float and the model re-quantized, up to `max_excluded` nodes. The stage
info lists each kept node, what it bought (cosine) and cost (weights left in float).
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import onnx
from pydantic import Field

from optpipe.evaluation.accuracy import compare, run_onnx
from optpipe.artifact import ModelArtifact, save_model, write_info
from optpipe.calibration.ranges import CalibrationCache, ranges_key
from optpipe.calibration.readers import ort_calibration_reader
from optpipe.errors import PassError, first_line
from optpipe.graph.stats import graph_stats, op_changes, op_histogram
from optpipe.metrics import Accuracy
from optpipe.pass_base import Pass, PassContext, PassParams

STATIC_OPS = ["MatMul", "Gemm", "Conv"]
DYNAMIC_OPS = ["MatMul", "Gemm", "Conv", "Attention"]  # never Gather: int8 embedding tables cost accuracy for no speed
METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


class Int8Params(PassParams):
    mode: Literal["static", "dynamic"] = Field("static", description="static: calibrated QDQ (ORT CPU and TensorRT); dynamic: ORT CPU only")
    method: Literal["minmax", "entropy", "percentile"] = Field("minmax", description="static: calibration method")
    percentile: float = Field(99.999, gt=90, le=100, description="static, method percentile: the range's percentile")
    per_channel: bool = Field(True, description="one scale per output channel of each weight")
    op_types: Optional[list[str]] = Field(None, description="op types to quantize (default: static MatMul/Gemm/Conv, dynamic also Attention)")
    exclude: list[str] = Field(default_factory=list, description="node names to keep in float")
    reduce_range: bool = Field(False, description="7-bit weights (only for CPUs without VNNI)")
    target: Literal["tensorrt", "ort-cpu"] = Field(
        "tensorrt",
        description="static: tensorrt = symmetric int8 Q/DQ on inputs (explicit quantization); "
        "ort-cpu = uint8 asymmetric activations, Q/DQ on outputs, int32 bias: ORT's integer kernels, not for TensorRT",
    )
    calibration_batch: int = Field(8, ge=1, description="static: samples per calibration batch")
    guard: bool = Field(True, description="keep the worst nodes in float until the stage's tolerance holds")
    max_excluded: int = Field(8, ge=0, description="guard: most nodes to keep in float")
    rank_samples: int = Field(4, ge=1, description="guard: evaluation samples used to rank nodes by error")


class Int8Pass(Pass[Int8Params]):
    """Quantize to INT8 (static QDQ calibrated on the recipe's data, or dynamic), guarded by the stage's tolerance."""

    name = "int8"
    version = "1"
    Params = Int8Params
    libraries = ("onnx", "onnxruntime", "onnxruntime-gpu")

    def fingerprint(self, ctx: PassContext) -> dict:
        params = self.params
        # The calibration set's key covers its file's content: new data re-runs the stage.
        calibration = ctx.calibration_set().key if params.mode == "static" else None
        guard = {"eval": ctx.eval_set().key, "tolerance": ctx.tolerance.model_dump(mode="json")} if params.guard else None
        return {"calibration": calibration, "guard": guard}

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        quantizer = Quantizer(model, params, ctx)
        try:
            excluded = list(params.exclude)
            path = quantizer.quantize(excluded)
            guard = Guard(model, params, ctx)
            accuracy = guard.check(path)
            steps = [_step(None, accuracy)]
            if not accuracy.within_tolerance and params.guard and params.max_excluded:
                path, accuracy, excluded, steps = guard.repair(path, accuracy, quantizer, excluded, steps)
            artifact = save_model(onnx.load(str(path)), ctx.workdir)
        finally:
            shutil.rmtree(quantizer.scratch, ignore_errors=True)  # the cache entry holds only the model
        info = quantizer.info(artifact)
        info["excluded"] = excluded
        info["guard"] = {
            "enabled": params.guard,
            "held": accuracy.within_tolerance,
            "cosine": accuracy.worst_cosine,
            "violations": accuracy.violations,
            "steps": steps,
        }
        if not accuracy.within_tolerance:
            ctx.log.warning("int8 result breaks the tolerance: %s", "; ".join(accuracy.violations))
        return write_info(ctx.workdir, info)


# --- quantization ---------------------------------------------------------------------------


class Quantizer:
    """Quantizes one input model repeatedly (with different exclusions), calibrating at most once."""

    def __init__(self, model: ModelArtifact, params: Int8Params, ctx: PassContext):
        self.model = model
        self.params = params
        self.ctx = ctx
        self.op_types = params.op_types or (STATIC_OPS if params.mode == "static" else DYNAMIC_OPS)
        self.scratch = Path(tempfile.mkdtemp(prefix="int8-", dir=ctx.workdir))
        self.calibration: dict | None = None
        self.runs = 0

    def quantize(self, excluded: list[str]) -> Path:
        self.runs += 1
        out = self.scratch / f"quantized-{self.runs}.onnx"
        started = time.perf_counter()
        try:
            with root_logs_to(self.ctx.log):
                if self.params.mode == "static":
                    self._static(out, excluded)
                else:
                    self._dynamic(out, excluded)
        except PassError:
            raise
        except Exception as exc:  # ORT's quantizer raises assorted errors on graphs it cannot handle
            self.ctx.log.exception("quantization failed")
            raise PassError(f"ONNX Runtime's {self.params.mode} quantization failed: {first_line(exc)}; "
                            "try the other `mode` or narrow `op_types`") from None
        self.ctx.log.info("quantized (%d excluded) in %.1fs", len(excluded), time.perf_counter() - started)
        return out

    def _dynamic(self, out: Path, excluded: list[str]) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(
            self.model.path,
            out,
            op_types_to_quantize=self.op_types,
            per_channel=self.params.per_channel,
            reduce_range=self.params.reduce_range,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded,
            use_external_data_format=True,
            # Fused transformer ops (com.microsoft) carry no type information ORT's quantizer can read.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, "MatMulConstBOnly": True},
        )

    def _static(self, out: Path, excluded: list[str]) -> None:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

        samples = self.ctx.calibration_set()  # built once per content, then loaded from its cache
        ranges = self._ranges(samples.key)
        reader = None if ranges.cached else ort_calibration_reader(samples, self.model.path, self.params.calibration_batch)
        with CalibrationCache(self.ctx.cache_dir).lock(ranges.key):
            started = time.perf_counter()
            quantize_static(
                self.model.path,
                out,
                calibration_data_reader=reader,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=self.op_types,
                per_channel=self.params.per_channel,
                reduce_range=self.params.reduce_range,
                activation_type=QuantType.QInt8 if self.for_tensorrt else QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=excluded,
                use_external_data_format=True,
                calibrate_method=getattr(CalibrationMethod, METHODS[self.params.method]),
                extra_options=self._static_options(),
                calibration_cache_path=ranges.path,
            )
        if self.calibration is None:
            self.calibration = {
                "method": self.params.method,
                "cached": ranges.cached,
                "key": ranges.key,
                "samples": len(samples),
                "set_key": samples.key,
                "set_cached": samples.cached,
                "seconds": None if ranges.cached else round(time.perf_counter() - started, 2),
            }

    def _ranges(self, samples_key: str):
        cache = CalibrationCache(self.ctx.cache_dir)
        key = ranges_key(
            self.model.content_hash(),
            samples_key,
            self.params.method,
            self.op_types,
            {**self._calibration_options(), "batch": self.params.calibration_batch},
        )
        return cache.ranges(key)

    @property
    def for_tensorrt(self) -> bool:
        return self.params.target == "tensorrt"

    def _calibration_options(self) -> dict:
        options = {"CalibTensorRangeSymmetric": True} if self.for_tensorrt else {}
        if self.params.method == "percentile":
            options["CalibPercentile"] = self.params.percentile
        return options

    def _static_options(self) -> dict:
        if not self.for_tensorrt:
            # ORT's own QDQ defaults (uint8 activations with zero points, Q/DQ around each op's
            # inputs and outputs, int32 bias): the form its CPU provider fuses into QLinearConv /
            # QLinearMatMul. ResNet-50 measured 2.46x its FP32 speed this way, 0.82x with the
            # TensorRT form (symmetric int8 keeps ORT CPU on DequantizeLinear + FP32 kernels).
            return {**self._calibration_options(), "MatMulConstBOnly": True}
        return {
            **self._calibration_options(),
            # Symmetric int8 (zero point 0) activations and weights: what TensorRT requires.
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            # TensorRT has no int32 Q/DQ: keep biases in float (ORT fuses them either way).
            "QuantizeBias": False,
            # Activation x activation MatMuls (attention scores) stay in float.
            "MatMulConstBOnly": True,
            # Q/DQ on inputs only (TensorRT's recommended placement). Quantizing the outputs too
            # put int8 steps on the residual stream: MiniLM's cosine fell from 0.970 to 0.817.
            "OpTypesToExcludeOutputQuantization": list(self.op_types),
        }

    def info(self, artifact: ModelArtifact) -> dict:
        before = op_histogram(self.model.load(with_weights=False))
        after = graph_stats(artifact.load(with_weights=False))
        return {
            "mode": self.params.mode,
            "format": "QDQ" if self.params.mode == "static" else "dynamic (MatMulInteger)",
            "op_types": self.op_types,
            "per_channel": self.params.per_channel,
            "symmetric": self.params.mode == "static" and self.for_tensorrt,
            "target": self.params.target if self.params.mode == "static" else "ort-cpu",
            "calibration": self.calibration,
            "quantizations": self.runs,
            "op_changes": op_changes(before, after["ops"]),
            "graph": after,
        }


@contextlib.contextmanager
def root_logs_to(log: logging.Logger):
    """ORT's quantizer logs advice on the root logger: keep it in the stage log, off the terminal."""

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # Only the root logger's own records (ORT's), never ours propagating up: no loop.
            if record.name == "root":
                log.log(record.levelno, "onnxruntime.quantization: %s", record.getMessage())

    root = logging.getLogger()
    handler = Forward()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


# --- the accuracy guard -----------------------------------------------------------------------


class Guard:
    """Compares quantized models with the pass's input on the evaluation set, and repairs them."""

    def __init__(self, model: ModelArtifact, params: Int8Params, ctx: PassContext):
        self.model = model
        self.params = params
        self.ctx = ctx
        settings = ctx.recipe.evaluate
        self.threads = settings.threads
        samples = ctx.eval_set()
        self.inputs = samples.arrays
        self.batches = list(samples.batches(settings.accuracy_batch))
        self.reference = run_onnx(model.path, self.batches, self.threads)

    def check(self, path: Path) -> Accuracy:
        outputs = run_onnx(path, self.batches, self.threads)
        return compare(outputs, self.reference, self.inputs, self.ctx.tolerance, "input")

    def rank(self, quantized: Path, candidates: list[onnx.NodeProto]):
        """Candidate nodes by the error each adds in the quantized model (layer-wise, on a few samples)."""
        from optpipe.evaluation.error_attribution import blame_nodes, run_with_outputs

        source = self.model.load()
        names = [name for node in candidates for name in (*node.input, *node.output) if name]
        feeds = {k: v[: self.params.rank_samples] for k, v in self.inputs.items()}
        reference = run_with_outputs(source, names_in(source, names), feeds, self.threads)
        quantized_proto = onnx.load(str(quantized))
        candidate = run_with_outputs(quantized_proto, names_in(quantized_proto, names), feeds, self.threads)
        skip = {node.name for node in source.graph.node} - {node.name for node in candidates}
        return blame_nodes(source, reference, candidate, skip=skip)

    def repair(self, path: Path, accuracy: Accuracy, quantizer: Quantizer, excluded: list[str], steps: list[dict]):
        """Keep the worst node in float, re-quantize, re-check; until the tolerance holds or the limit."""
        candidates = quantized_nodes(self.model, quantizer.op_types, excluded)
        weights = weight_sizes(self.model, candidates)
        total = sum(weights.values()) or 1
        ranking = self.rank(path, candidates)
        self.ctx.log.info("nodes by added error: %s", [(e.node, round(e.added_error, 4)) for e in ranking[:12]])
        kept = 0
        for error in ranking[: 2 * self.params.max_excluded]:
            trial = quantizer.quantize(excluded + [error.node])
            result = self.check(trial)
            step = _step(error.node, result, accuracy) | {
                "op_type": error.op,
                "added_error": round(error.added_error, 5),
                "float_weights": weights.get(error.node, 0),
                "float_weight_share": round(weights.get(error.node, 0) / total, 4),
            }
            # The ranking is local; a node whose exclusion buys nothing end to end stays quantized.
            step["kept"] = result.worst_cosine > accuracy.worst_cosine
            steps.append(step)
            self.ctx.log.info("tried %s in float: cosine %.5f (kept: %s)", error.node, result.worst_cosine, step["kept"])
            if step["kept"]:
                excluded, path, accuracy = excluded + [error.node], trial, result
                kept += 1
            if accuracy.within_tolerance or kept >= self.params.max_excluded:
                break
        return path, accuracy, excluded, steps


def _step(node: str | None, accuracy: Accuracy, before: Accuracy | None = None) -> dict:
    step = {"node": node, "cosine": round(accuracy.worst_cosine, 6), "within_tolerance": accuracy.within_tolerance}
    if before is not None:
        step["bought_cosine"] = round(accuracy.worst_cosine - before.worst_cosine, 6)
    return step


def names_in(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """The tensors of `names` that `model`'s nodes compute (quantizers keep node boundary names)."""
    produced = {out for node in model.graph.node for out in node.output}
    return [name for name in dict.fromkeys(names) if name in produced]


def quantized_nodes(model: ModelArtifact, op_types: list[str], excluded: list[str]) -> list[onnx.NodeProto]:
    """Named nodes the quantizer would touch: of the op types, with a constant weight input."""
    proto = model.load(with_weights=False)
    initializers = {init.name for init in proto.graph.initializer}
    return [
        node
        for node in proto.graph.node
        if node.name and node.name not in excluded and node.op_type in op_types and any(i in initializers for i in node.input[1:2])
    ]


def weight_sizes(model: ModelArtifact, nodes: list[onnx.NodeProto]) -> dict[str, int]:
    """Elements of each node's weight: what stays in float (and slower) when the node is kept."""
    proto = model.load(with_weights=False)
    sizes = {init.name: int(np.prod(init.dims)) for init in proto.graph.initializer}
    return {node.name: sizes.get(node.input[1], 0) for node in nodes if len(node.input) > 1}
