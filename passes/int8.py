"""int8: INT8 quantization with ONNX Runtime, static (QDQ, calibrated) or dynamic, with an accuracy guard.

Static mode writes the one format that is both fast on ORT CPU and consumed directly by
TensorRT's explicit quantization: QDQ, signed int8 activations and weights, symmetric
(zero points 0), per-channel weights, no int32 bias Q/DQ (TensorRT has none). Only the
ops that do the arithmetic (MatMul with constant weights, Gemm, Conv) are quantized:
Q/DQ around every op is what made naive static QDQ 5x slower (DESIGN.md).
Dynamic mode quantizes weights ahead of time and activations at run time (ORT CPU only).

Guard (optpipe.evaluation.guard, shared with fp16): the result is compared with the pass's
input on the evaluation set; while it breaks the stage's tolerance, the quantized node that
adds the most error is kept in float and the model re-quantized, within the guard's budget.
The stage info lists each try, what it bought (cosine) and cost (weights left in float).
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import onnx
from pydantic import Field, model_validator

from optpipe.core.artifact import ModelArtifact, adopt_model, save_model, write_info
from optpipe.core.process_memory import release_freed_memory
from optpipe.calibration.ranges import CalibrationCache, ranges_key
from optpipe.calibration.readers import ort_calibration_reader
from optpipe.core.errors import PassError, UserInputError, first_line
from optpipe.evaluation.guard import AccuracyGuard, GuardParams, accuracy_batch
from optpipe.evaluation.guard_types import guard_criteria
from optpipe.graph.coverage import precision_coverage, quantization_warning
from optpipe.graph.stats import graph_stats, op_changes, op_histogram
from optpipe.graph.quant_prep import needs_preparation, prepare_for_quantizer
from optpipe.hardware.cpu_features import engine_target
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams
from optpipe.passes._library_logs import root_logs_to
from optpipe.passes._int8_formats import FormatName, Int8Format, for_graph, ort_format, tensorrt_format

STATIC_OPS = ["MatMul", "Gemm", "Conv"]
# never Gather: int8 embedding tables cost accuracy for no speed. LSTM: ORT's dynamic quantizer
# writes com.microsoft.DynamicQuantizeLSTM (int8 W and R); its static (QDQ) path has no recurrent op.
DYNAMIC_OPS = ["MatMul", "Gemm", "Conv", "Attention", "LSTM"]
METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


class Int8Params(PassParams, GuardParams):
    mode: Literal["static", "dynamic"] = Field("static", description="static: calibrated QDQ (ORT CPU and TensorRT); dynamic: ORT CPU only")
    method: Literal["minmax", "entropy", "percentile"] = Field("minmax", description="static: calibration method")
    percentile: float = Field(99.999, gt=90, le=100, description="static, method percentile: the range's percentile")
    per_channel: bool = Field(True, description="one scale per output channel of each weight")
    op_types: Optional[list[str]] = Field(None, description="op types to quantize (default: static MatMul/Gemm/Conv, dynamic also Attention and LSTM)")
    format: FormatName = Field(
        "auto", description="ORT's integer kernels (dynamic, or static target ort-cpu): auto = per this CPU's class "
        "(u8s8 with VNNI and on Arm, u8s8-reduce-range without VNNI: no int16 saturation); u8s8, u8s8-reduce-range, u8u8 force one")
    reduce_range: Optional[bool] = Field(None, description="7-bit weights on or off; default: as the format says")
    weight_symmetric: Optional[bool] = Field(
        None, description="weights without (true) or with (false) a zero point per channel; default: as the format says "
        "(asymmetric for dynamic u8s8-reduce-range, symmetric otherwise; static: always symmetric)")
    target: Literal["tensorrt", "ort-cpu"] = Field(
        "tensorrt",
        description="static: tensorrt = symmetric int8 Q/DQ on inputs (explicit quantization); "
        "ort-cpu = uint8 asymmetric activations, Q/DQ on outputs, int32 bias: ORT's integer kernels, not for TensorRT",
    )
    calibration_batch: int = Field(8, ge=1, description="static: samples per calibration batch")

    @model_validator(mode="after")
    def _format_is_for_ort_kernels(self):
        if self.format != "auto" and self.mode == "static" and self.target == "tensorrt":
            raise ValueError(f"format '{self.format}' is for ORT's integer kernels (mode dynamic, or static with target "
                             "ort-cpu); target tensorrt always takes symmetric s8s8")
        if self.weight_symmetric is False and self.mode == "static":
            # ORT's QDQ quantizer wrote the same symmetric per-channel weights with or without it (ResNet-50, ort-cpu).
            raise ValueError("weight_symmetric false is for mode dynamic: static Q/DQ writes symmetric int8 weights "
                             "(and TensorRT's explicit quantization takes no other)")
        return self


class Int8Pass(Pass[Int8Params]):
    """Quantize to INT8 (static QDQ calibrated on the recipe's data, or dynamic), guarded by the stage's tolerance."""

    name = "int8"
    version = "8"  # 3: fused ops split and stale weight value_info dropped before quantizing; 4: format per CPU class; 5: u8u8 on AVX2
    # 6: u8s8-reduce-range with asymmetric weights, and auto's pick on AVX2 again; 7: an input below opset 13 upgraded
    # first (graph/quant_prep.py: per-channel QDQ wrote opset 13's `axis` into an opset-9 model); 8: the guard keeps a
    # node in float where it brings the error as the verdict reads it down (R², the task's metric), not the cosine alone
    Params = Int8Params
    libraries = ("onnx", "onnxruntime", "onnxruntime-gpu")
    # The format is chosen per CPU class and the guard decides on this CPU's numerics.
    isa_dependent = True

    @property
    def needs_calibration(self) -> bool:
        """Static mode calibrates on `data.calibration` (checked by `optpipe validate`)."""
        return self.params.mode == "static"

    def fingerprint(self, ctx: PassContext) -> dict:
        # The guard always measures (and, when on, repairs) with the stage's tolerance. The data sets
        # the pass reads (calibration, evaluation) join the stage's key by themselves (PassContext.data_used).
        return {"guard": guard_criteria(ctx)}

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        ctx.progress("int8: prepare the input for ORT's quantizer", 0, 0)
        _refuse_half(model, ctx.stage)
        model, prepared = prepared_input(model, ctx)
        quantizer = Quantizer(model, params, ctx)
        candidates = quantized_nodes(model, quantizer.op_types, params.exclude)
        weights = weight_sizes(model, candidates)
        total = sum(weights.values()) or 1

        def float_weights(node: str) -> dict:
            return {"float_weights": weights.get(node, 0), "float_weight_share": round(weights.get(node, 0) / total, 4)}

        try:
            guard = AccuracyGuard(ctx, model, params, quantizer.quantize,
                                  candidates={n.name for n in candidates}, node_facts=float_weights)
            result = guard.run(params.exclude)
            ctx.progress("int8: save the model and count its int8 coverage", 0, 0)
            artifact = adopt_model(Path(result.model), ctx.workdir)  # ORT wrote one data file: moved, not read
        finally:
            shutil.rmtree(quantizer.scratch, ignore_errors=True)  # the cache entry holds only the model
        info = quantizer.info(artifact)
        if prepared:
            shutil.rmtree(model.folder, ignore_errors=True)
        info["prepared"] = prepared
        info["excluded"] = result.excluded
        info["coverage"] = coverage_of(artifact, ctx, result.excluded)
        info["guard"] = result.report.model_dump(mode="json")
        return write_info(ctx.workdir, info)


def _refuse_half(model: ModelArtifact, stage: str) -> None:
    """ORT's quantizer reads float32 graphs: on one in float16 (an ONNX file saved in half) it wrote a model ONNX Runtime
    refused ("Type 'tensor(float16)' of input ..."), reported as an internal error of the pass."""
    graph = model.load(with_weights=False).graph
    half = onnx.TensorProto.FLOAT16
    weights = {t.name for t in graph.initializer if t.data_type == half}
    found = [i.name for i in graph.input if i.type.tensor_type.elem_type == half]
    found += [n.input[1] for n in graph.node if n.op_type in ("MatMul", "Gemm", "Conv") and len(n.input) > 1 and n.input[1] in weights]
    if found:
        raise UserInputError(f"stages.{stage}: int8 quantizes a float32 model, and this one computes in float16 ('{found[0]}'); "
                             "export it in float32 and hang int8 there (the fp16 stage gives the float16 candidate)")


def prepared_input(model: ModelArtifact, ctx: PassContext) -> tuple[ModelArtifact, dict]:
    """The input made fit for ORT's quantizer (optpipe.graph.quant_prep: fused ops split back,
    stale initializer value_info dropped); the input itself where nothing needs it."""
    if not needs_preparation(model.load(with_weights=False)):
        return model, {}
    prepared, changes = prepare_for_quantizer(model.load())
    ctx.log.info("prepared the input for ORT's quantizer: %s", changes)
    return save_model(prepared, Path(tempfile.mkdtemp(prefix="prepared-", dir=ctx.workdir))), changes


def coverage_of(artifact: ModelArtifact, ctx: PassContext, excluded: list[str]) -> dict:
    """The int8 share of weights and MACs; warns in the log when most compute stayed in float."""
    dims = {name: dim.opt for name, dim in ctx.inputs.dims.items()}
    coverage = precision_coverage(artifact.load(with_weights=False), dims, excluded=set(excluded))
    warning = quantization_warning(coverage)
    if warning:
        ctx.log.warning("int8: %s", warning)
    return coverage.model_dump(mode="json")


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
        cpu = engine_target("onnxruntime")
        self.format: Int8Format = (tensorrt_format(cpu, params.reduce_range) if params.mode == "static" and self.for_tensorrt
                                   else ort_format(params.format, cpu, params.reduce_range, params.weight_symmetric,
                                                  static=params.mode == "static"))
        self.input_ops = op_histogram(model.load(with_weights=False))  # also the info's "before"
        try:
            self.format = for_graph(self.format, set(self.input_ops) & set(self.op_types), params.weight_symmetric)
        except ValueError as exc:
            raise PassError(str(exc)) from None
        ctx.log.info("int8 format %s (%s)", self.format.name, self.format.why)

    def quantize(self, excluded: list[str]) -> Path:
        # ORT's quantizer loads the whole model: what the preparation or the last try freed goes back first
        # (BERT-large's dynamic int8 started 1.2 GB above the process's baseline).
        release_freed_memory()
        self.runs += 1
        out = self.scratch / f"quantized-{self.runs}.onnx"
        started = time.perf_counter()
        # Dynamic: one call with no hook inside (the console's heartbeat shows its time); static: the
        # calibration reader counts the batches ORT reads (_static).
        self.ctx.progress(f"int8: ORT quantize_{self.params.mode} ({len(excluded)} nodes in float)", self.runs, self.runs)
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
        from onnxruntime.quantization import quantize_dynamic

        quantize_dynamic(
            self.model.path,
            out,
            op_types_to_quantize=self.op_types,
            per_channel=self.params.per_channel,
            reduce_range=self.format.reduce_range,
            weight_type=_quant_type(self.format.weights),
            nodes_to_exclude=dynamic_exclusions(excluded),
            use_external_data_format=True,
            # Fused transformer ops (com.microsoft) carry no type information ORT's quantizer can read.
            # Weights symmetric as Optimum's presets (u8 weights: zero point 128), except where the format
            # says otherwise (passes/_int8_formats.py: 7-bit weights get a zero point per channel).
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, "MatMulConstBOnly": True,
                           "WeightSymmetric": self.format.weight_symmetric},
        )

    def _static(self, out: Path, excluded: list[str]) -> None:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

        samples = self.ctx.calibration_set()  # built once per content, then loaded from its cache
        ranges = self._ranges(samples.key)
        reader = None if ranges.cached else ort_calibration_reader(samples, self.model.path, self._calibration_batch,
                                                                  progress=self._calibration_progress,
                                                                  whole=self.ctx.inputs.batch_dim() is None)
        with CalibrationCache(self.ctx.cache_dir).lock(ranges.key):
            started = time.perf_counter()
            quantize_static(
                self.model.path,
                out,
                calibration_data_reader=reader,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=self.op_types,
                per_channel=self.params.per_channel,
                reduce_range=self.format.reduce_range,
                activation_type=_quant_type(self.format.activations),
                weight_type=_quant_type(self.format.weights),
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
                "source": samples.origin,
                "set_key": samples.key,
                "set_cached": samples.cached,
                "seconds": None if ranges.cached else round(time.perf_counter() - started, 2),
            }

    def _calibration_progress(self, done: int, total: int) -> None:
        """ORT's calibrator reads the batches one by one (CalibrationDataReader.get_next); after the last
        one (done > total: it asked for more) it computes the ranges and quantizes the weights."""
        if done <= total:
            self.ctx.progress("int8: ORT calibration batch", done, total)
        else:
            self.ctx.progress("int8: ORT computes the ranges and quantizes the weights", 0, 0)

    def _ranges(self, samples_key: str):
        cache = CalibrationCache(self.ctx.cache_dir)
        key = ranges_key(
            self.model.content_hash(),
            samples_key,
            self.params.method,
            self.op_types,
            {**self._calibration_options(), "batch": self._calibration_batch},
        )
        return cache.ranges(key)

    @property
    def _calibration_batch(self) -> int:
        """`calibration_batch`, or the fixed batch of a model without a batch dim ([1, 3, 224, 224]: ORT refused the 8)."""
        return self.params.calibration_batch if self.ctx.inputs.batch_dim() else accuracy_batch(self.ctx.inputs, self.ctx.evaluate)

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
            return {**self._calibration_options(), "MatMulConstBOnly": True, "WeightSymmetric": self.format.weight_symmetric}
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
        after = graph_stats(artifact.load(with_weights=False))
        return {
            "mode": self.params.mode,
            "format": "QDQ" if self.params.mode == "static" else "dynamic (MatMulInteger)",
            "op_types": self.op_types,
            "per_channel": self.params.per_channel,
            "symmetric": self.params.mode == "static" and self.for_tensorrt,
            # Which int8 format, on which CPU class, and why (the choice per ISA: passes/_int8_formats.py).
            "int8_format": self.format.record(),
            "target": self.params.target if self.params.mode == "static" else "ort-cpu",
            "calibration": self.calibration,
            "quantizations": self.runs,
            "op_changes": op_changes(self.input_ops, after["ops"]),
            "graph": after,
        }


def _quant_type(dtype: str):
    from onnxruntime.quantization import QuantType

    return QuantType.QUInt8 if dtype == "uint8" else QuantType.QInt8


def dynamic_exclusions(excluded: list[str]) -> list[str]:
    """The names to exclude from ORT's dynamic quantizer: it first rewrites every Gemm into a MatMul
    named `<gemm>_MatMul` (+ `<gemm>_Add`) and matches the exclusions against the new names, so an
    excluded Gemm was quantized anyway (measured: an LSTM classifier's head stayed MatMulInteger)."""
    return [*excluded, *(f"{name}_MatMul" for name in excluded)]


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
