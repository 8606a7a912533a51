"""openvino: the stage's ONNX as an OpenVINO IR, in FP32, BF16 or INT8 (NNCF post-training quantization).

The output is an IR stage (`model.xml` + `model.bin` + `openvino.json`, the compile settings it
is measured and deployed with); every later measurement of it runs on OpenVINO's CPU runtime.
No ONNX pass can follow it.

- fp32 / bf16: `openvino.convert_model` of the input ONNX; the same IR, compiled with
  INFERENCE_PRECISION_HINT f32 or bf16 (bf16 only where the CPU plugin lists BF16).
- int8: `nncf.quantize` on the cached calibration set (NNCF's TRANSFORMER model type where the
  graph has attention), FakeQuantize ops in the IR that the CPU plugin runs as int8 kernels.
  Guard: the result is compared with the input ONNX (run by ONNX Runtime) on the evaluation set;
  when it breaks the stage's tolerance, `nncf.quantize_with_accuracy_control` re-quantizes,
  reverting the quantizers that cost the most (up to `max_excluded`) until the cosine holds.

The stage info records the precision the compiled model really runs at (its
INFERENCE_PRECISION_HINT and the number of layers per runtime precision).
"""
from __future__ import annotations

import logging
from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field

from optpipe.artifact import ModelArtifact, write_info
from optpipe.errors import DataError, PassError, RecipeError, first_line
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.results import Accuracy
from optpipe.pass_base import Pass, PassContext, PassParams

class OpenVinoParams(PassParams):
    precision: Literal["fp32", "bf16", "int8"] = Field("fp32", description="fp32 / bf16 (inference precision hint) or int8 (NNCF)")
    model_type: Literal["auto", "transformer", "other"] = Field(
        "auto", description="int8: NNCF's TRANSFORMER model type; auto: when the graph has attention (Softmax feeding MatMul)"
    )
    preset: Optional[Literal["performance", "mixed"]] = Field(
        None, description="int8: NNCF preset (mixed: asymmetric activations); default NNCF's choice for the model type"
    )
    subset_size: int = Field(300, ge=1, description="int8: calibration samples NNCF uses (at most the calibration set)")
    fast_bias_correction: bool = Field(True, description="int8: NNCF's fast bias correction (false: the full algorithm)")
    smooth_quant_alpha: Optional[float] = Field(
        None, le=1.0, description="int8: SmoothQuant alpha for MatMul (negative disables); default NNCF's for the model type"
    )
    exclude: list[str] = Field(
        default_factory=list, description="int8: nodes kept in float: ONNX node names (every IR op converted from the node) "
        "or the IR's op names; a name that matches nothing is refused")
    exclude_types: list[str] = Field(default_factory=list, description="int8: op types kept in float, OpenVINO names (e.g. MatMul; "
                                     "a type the IR lacks is refused)")
    guard: bool = Field(True, description="int8: hold the stage's tolerance with NNCF's accuracy-controlled quantization")
    max_excluded: int = Field(8, ge=0, description="guard: most quantizers NNCF may revert to float")


#: Params that only the int8 path reads: set on an fp32 / bf16 stage, they change nothing (the report says so).
INT8_ONLY = frozenset({"model_type", "preset", "subset_size", "fast_bias_correction", "smooth_quant_alpha", "exclude",
                       "exclude_types", "guard", "max_excluded"})


class OpenVinoPass(Pass):
    """Convert to OpenVINO IR (FP32, BF16 or NNCF INT8), measured on OpenVINO's CPU runtime."""

    name = "openvino"
    # 2: an exclude_types entry that is no op type of the IR is refused (a cached 1 may hold a stage that excluded nothing)
    # 3: an exclude entry takes every IR op converted from that ONNX node (a cached 2 kept only the op named exactly so);
    #    the info records ignored int8-only params and the IR's compute ops
    # 4: the guard holds the whole tolerance (top-1, max_abs), not the cosine alone
    # 5: an FP32 conversion that breaks the tolerance is refused; fused attention ops make the graph a transformer
    # 6: a smooth_quant_alpha NNCF ignores (no transformer) is recorded
    version = "6"
    Params = OpenVinoParams
    libraries = ("onnx", "openvino", "nncf")
    produces = "openvino-ir"  # no ONNX pass may follow this stage (optpipe.validate)

    #: What calibrates and the other way out, for `optpipe validate` when the recipe has no data.calibration.
    calibration_use = ("OpenVINO int8 (NNCF)", "set `params: {precision: fp32}`")

    @property
    def needs_calibration(self) -> bool:
        return self.params.precision == "int8"  # type: ignore[attr-defined]

    def fingerprint(self, ctx: PassContext) -> dict:
        params: OpenVinoParams = self.params  # type: ignore[assignment]
        # The data sets the pass reads (calibration, evaluation) join the stage's key by themselves (PassContext.data_used).
        if params.precision != "int8" or not params.guard:
            return {}
        return {"guard": {"tolerance": ctx.tolerance.model_dump(mode="json")}}

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params: OpenVinoParams = self.params  # type: ignore[assignment]
        if not ovr.supports(params.precision):
            raise PassError(f"this CPU cannot run bf16 in OpenVINO (its capabilities: {', '.join(ovr.cpu_capabilities())}); "
                            "use precision fp32 or int8")
        try:
            converted = ovr.convert_onnx(model.path)
        except Exception as exc:  # the converter raises assorted errors on ops it cannot translate
            raise PassError(f"OpenVINO cannot convert this ONNX model: {ovr.conversion_failure(exc)}") from None
        check = InputCheck(model, ctx)
        info: dict[str, Any] = {"runtime": ovr.RUNTIME, "precision": params.precision}
        ignored = sorted(params.model_fields_set & INT8_ONLY) if params.precision != "int8" else []
        if ignored:
            # Not refused: a search over precision may keep them set for its int8 points. Said in the report.
            info["ignored_params"], info["ignored_why"] = ignored, "only to precision int8"
            ctx.log.warning("precision %s: %s apply only to int8, ignored", params.precision, ", ".join(ignored))
        if params.precision == "int8":  # the conversion is checked there, only when the int8 result breaks the tolerance
            result, accuracy, info["int8"] = quantize(converted, model, params, ctx, check)
            if params.smooth_quant_alpha is not None and info["int8"]["options"]["model_type"] != "transformer":
                # NNCF runs SmoothQuant for its TRANSFORMER model type only: the alpha changed nothing (measured).
                info["ignored_params"], info["ignored_why"] = ["smooth_quant_alpha"], "only to model_type transformer"
                ctx.log.warning("smooth_quant_alpha ignored: NNCF applies SmoothQuant to transformer models only")
        else:
            result = converted
            accuracy = check_conversion(converted, model, check)
            if params.precision != "fp32":
                accuracy = check(result, ovr.PRECISION_HINTS[params.precision])
        ovr.save_ir(result, ctx.workdir)
        hint = ovr.write_settings(ctx.workdir, params.precision)["hint"]
        compiled = ovr.compile_model(ctx.workdir / ovr.IR_FILE, ctx.recipe.evaluate.threads, hint)
        info.update(ovr.precision_facts(compiled))
        info["ir_compute_ops"] = sum(op.get_type_name() in ovr.COMPUTE_LAYERS for op in result.get_ops())
        info["output_names"] = ovr.output_names(model.path)
        info["check"] = {"cosine": accuracy.worst_cosine, "held": accuracy.within_tolerance, "violations": accuracy.violations}
        if not accuracy.within_tolerance:
            ctx.log.warning("openvino %s result breaks the tolerance: %s", params.precision, "; ".join(accuracy.violations))
        return write_info(ctx.workdir, info)


# --- checking against the input -------------------------------------------------------------


class InputCheck:
    """Compares an ov.Model with the pass's input ONNX (run by ONNX Runtime) on the evaluation set."""

    def __init__(self, model: ModelArtifact, ctx: PassContext):
        self.model, self.ctx = model, ctx
        self.names = ovr.output_names(model.path)
        self._reference = None

    @property
    def batch_size(self) -> int:
        """The evaluation's accuracy batch (a model without a batch dim: its fixed one), as the guard's."""
        from optpipe.evaluation.guard import accuracy_batch

        return accuracy_batch(self.ctx.recipe)

    @property
    def batches(self) -> list[dict[str, np.ndarray]]:
        size, samples = self.batch_size, self.ctx.eval_set()
        if not self.ctx.recipe.batch_dim() and len(samples) % size:
            # The IR (and ONNX Runtime) refuse a partial batch of a fixed-batch model: the data's fault, said so.
            raise DataError(f"data.eval: {len(samples)} samples do not fill whole batches of the model's fixed batch {size}; "
                            f"give a multiple of {size}")
        return list(samples.batches(size))

    def reference(self):
        if self._reference is None:
            from optpipe.evaluation.accuracy import run_onnx

            self._reference = run_onnx(self.model.path, self.batches, self.ctx.recipe.evaluate.threads)
        return self._reference

    def outputs(self, compiled) -> dict[str, np.ndarray]:
        from optpipe.evaluation.accuracy import run_callable

        return run_callable(ovr.runner(compiled, self.names), self.batches)

    def compare(self, outputs) -> Accuracy:
        from optpipe.evaluation.accuracy import compare

        ctx = self.ctx
        return compare(outputs, self.reference(), ctx.eval_set().arrays, ctx.tolerance, ctx.stage + " input", ctx.recipe.evaluate.top1)

    def __call__(self, ov_model, hint: str = "f32") -> Accuracy:
        return self.compare(self.outputs(ovr.compile_model(ov_model, self.ctx.recipe.evaluate.threads, hint)))


def check_conversion(converted, model: ModelArtifact, check: InputCheck) -> Accuracy:
    """OpenVINO's FP32 translation must compute what ONNX Runtime computes on the input, within the
    stage's tolerance, before any precision is asked of it. ONNX Runtime's own contrib ops (the fuse
    pass's MultiHeadAttention, SkipLayerNormalization, ...) convert without error yet compute
    something else: a BERT after fuse came out at cosine 0.69 in FP32, and its int8 stage 'ok'."""
    accuracy = check(converted, "f32")
    if accuracy.within_tolerance:
        return accuracy
    contrib = sorted({f"{n.domain}:{n.op_type}" for n in model.load(with_weights=False).graph.node if n.domain not in ("", "ai.onnx")})
    cause = (f"; its ONNX Runtime-only ops ({', '.join(contrib)}) are the likely cause: hang this stage after a stage "
             "without them (e.g. simplify, not fuse)") if contrib else ""
    raise PassError(f"OpenVINO's FP32 conversion does not compute what the input ONNX does "
                    f"({'; '.join(accuracy.violations)}){cause}")


# --- INT8 through NNCF -----------------------------------------------------------------------


def quantize(converted, model: ModelArtifact, params: OpenVinoParams, ctx: PassContext, check: InputCheck):
    """NNCF post-training quantization, then accuracy control when the plain result breaks the tolerance."""
    import nncf

    check_exclude_types(params, converted, ctx.stage)
    calibration = calibration_batches(ctx, converted)
    options = nncf_options(params, model, len(calibration), exclude_names(params, model, converted, ctx.stage))
    ctx.log.info("nncf.quantize with %s", {k: str(v) for k, v in options.items()})
    with _nncf_logs_to(ctx.log):
        try:
            quantized = nncf.quantize(converted, nncf.Dataset(calibration), **options)
        except Exception as exc:
            raise PassError(f"NNCF quantization failed: {first_line(exc)}; try `exclude_types` or precision fp32") from None
        accuracy = check(quantized)
        steps = [{"method": "nncf.quantize", "cosine": accuracy.worst_cosine, "held": accuracy.within_tolerance,
                  "quantizers": _fake_quantize_count(quantized)}]
        if not accuracy.within_tolerance:
            # An int8 result within tolerance vouches for the conversion too (3 s of a MiniLM compile
            # saved); one that breaks it may be a broken conversion, which no excluded node can mend.
            check_conversion(converted, model, check)
        gave_up = None
        if not accuracy.within_tolerance and params.guard and params.max_excluded and ctx.tolerance.cosine_min:
            quantized, accuracy = _accuracy_controlled(converted, calibration, options, params, ctx, check)
            steps.append({"method": "nncf.quantize_with_accuracy_control", "cosine": accuracy.worst_cosine,
                          "held": accuracy.within_tolerance, "quantizers": _fake_quantize_count(quantized)})
        elif not accuracy.within_tolerance and params.guard:
            # NNCF's accuracy control restores one metric: optpipe's cosine. Without one, say so.
            gave_up = "the tolerance has no cosine_min for NNCF's accuracy control to hold" if not ctx.tolerance.cosine_min \
                else "max_excluded is 0"
            ctx.log.warning("openvino int8 guard not run: %s", gave_up)
    details = {
        "options": {k: str(v) for k, v in options.items()},
        "calibration_samples": options["subset_size"],
        "quantizers": _fake_quantize_count(quantized),
        "guard": {"enabled": params.guard, "held": accuracy.within_tolerance, "cosine": accuracy.worst_cosine,
                  "violations": accuracy.violations, "steps": steps, "not_run": gave_up},
    }
    return quantized, accuracy, details


def calibration_batches(ctx: PassContext, converted) -> list[dict[str, np.ndarray]]:
    """The calibration set in batches the model takes: one sample each, or a model without a batch
    dim's fixed batch (a trailing partial batch dropped: the model cannot take it)."""
    from optpipe.evaluation.guard import accuracy_batch

    samples = ctx.calibration_set()
    size = 1 if ctx.recipe.batch_dim() else accuracy_batch(ctx.recipe)
    if len(samples) < size:
        raise DataError(f"data.calibration: {len(samples)} samples, fewer than the model's fixed batch of {size}; "
                        f"give at least {size} samples")
    return [_model_feeds(b, converted) for b in samples.batches(size) if len(next(iter(b.values()))) == size]


def exclude_names(params: OpenVinoParams, model: ModelArtifact, converted, stage: str) -> list[str]:
    """`exclude` entries (ONNX node names, or the IR's op names) as the IR op names NNCF's ignored scope takes.

    Conversion renames and splits nodes: ONNX Gemm 'fc' (output 'h') becomes MatMul 'fc/WithoutBiases' + Add
    'fc', or ops named after the node's output tensor ('h', 'h/...'). NNCF matches exact names, so 'fc' alone
    would keep the Add in float and quantize the MatMul. An entry takes every op named after the node or its
    outputs (exactly or as a 'name/' prefix); an entry that names no op is refused, not silently ignored."""
    if not params.exclude:
        return []
    aliases: dict[str, set[str]] = {}
    for node in model.load(with_weights=False).graph.node:
        if node.name:
            aliases[node.name] = {node.name, *node.output}
    ops = [op.get_friendly_name() for op in converted.get_ops() if op.get_type_name() not in ("Constant", "Parameter", "Result")]
    names, missing = set(), []
    for entry in params.exclude:
        prefixes = aliases.get(entry, {entry})
        hits = [op for op in ops if op in prefixes or any(op.startswith(p + "/") for p in prefixes)]
        names.update(hits) if hits else missing.append(entry)
    if missing:
        known = sorted(aliases) or sorted(ops)
        raise RecipeError(f"stages.{stage}.params.exclude: {', '.join(missing)} names no node of this model (its ONNX node "
                          f"names, or its OpenVINO IR's op names); its nodes: {', '.join(known[:12])}"
                          + (f" and {len(known) - 12} more (optpipe inspect)" if len(known) > 12 else ""))
    return sorted(names)


def check_exclude_types(params: OpenVinoParams, converted, stage: str) -> None:
    """Each `exclude_types` entry is an op type of the converted IR. NNCF's ignored scope is built with
    validate=False (node names change in conversion), so a misspelt type ('Matmul') would exclude
    nothing, silently, and the stage would read as the asked-for mix: refused here, naming the types."""
    present = {op.get_type_name() for op in converted.get_ops()}
    missing = [name for name in params.exclude_types if name not in present]
    if missing:
        raise RecipeError(f"stages.{stage}.params.exclude_types: {', '.join(missing)} is no op type of this model's "
                          f"OpenVINO IR (names are case-sensitive); its op types: {', '.join(sorted(present))}")


def nncf_options(params: OpenVinoParams, model: ModelArtifact, samples: int, exclude: list[str] = ()) -> dict[str, Any]:
    import nncf

    transformer = params.model_type == "transformer" or (params.model_type == "auto" and has_attention(model))
    options: dict[str, Any] = {
        "subset_size": min(params.subset_size, samples),
        "fast_bias_correction": params.fast_bias_correction,
        "model_type": nncf.ModelType.TRANSFORMER if transformer else None,
    }
    if params.preset:
        options["preset"] = nncf.QuantizationPreset(params.preset)
    if exclude or params.exclude_types:
        # Every name and type was matched against the IR already (exclude_names, check_exclude_types).
        options["ignored_scope"] = nncf.IgnoredScope(names=list(exclude), types=list(params.exclude_types), validate=False)
    if params.smooth_quant_alpha is not None:
        options["advanced_parameters"] = nncf.AdvancedQuantizationParameters(
            smooth_quant_alphas=nncf.AdvancedSmoothQuantParameters(matmul=params.smooth_quant_alpha))
    return options


def _accuracy_controlled(converted, calibration, options, params: OpenVinoParams, ctx: PassContext, check: InputCheck):
    """NNCF ranks the quantizers by the error they add and reverts the worst until the metric
    (optpipe's own: the worst per-output mean cosine against the input) drops at most 1 - cosine_min."""
    import nncf

    indexed = list(enumerate(check.batches))

    def validate(compiled, items) -> float:
        run = ovr.runner(compiled, check.names)
        outs = [run(_model_feeds(feeds, converted)) for _, feeds in items]
        # Samples NNCF passes may be a subset: compare them with the matching reference rows.
        picked = [i for i, _ in items]
        return guard_metric(_subset_accuracy(check, picked, outs), ctx.tolerance.cosine_min)

    validation = nncf.Dataset(indexed, lambda item: _model_feeds(item[1], converted))
    restorer = nncf.AdvancedAccuracyRestorerParameters(max_num_iterations=params.max_excluded)
    ctx.log.info("plain INT8 broke the tolerance: nncf.quantize_with_accuracy_control, max_drop %.4f", 1 - ctx.tolerance.cosine_min)
    try:
        quantized = nncf.quantize_with_accuracy_control(
            converted, nncf.Dataset(calibration), validation, validate, max_drop=1.0 - ctx.tolerance.cosine_min,
            drop_type=nncf.DropType.ABSOLUTE, advanced_accuracy_restorer_parameters=restorer,
            **{("advanced_quantization_parameters" if k == "advanced_parameters" else k): v for k, v in options.items()},
        )
    except Exception as exc:
        raise PassError(f"NNCF accuracy-controlled quantization failed: {first_line(exc)}; set guard: false to keep plain INT8") from None
    return quantized, check(quantized)


def guard_metric(accuracy: Accuracy, cosine_min: float) -> float:
    """The one number NNCF's accuracy control holds (its drop from 1.0 at most 1 - cosine_min): the worst
    cosine, pushed below cosine_min while any other bound of the tolerance breaks. On cosine alone the
    guard stopped with the cosine held and top-1 agreement (or max_abs) still out of tolerance."""
    if accuracy.within_tolerance:
        return accuracy.worst_cosine
    return min(accuracy.worst_cosine, cosine_min - 1e-6)


def _subset_accuracy(check: InputCheck, picked: list[int], outs: list[dict]) -> Accuracy:
    from optpipe.evaluation.accuracy import compare

    size = check.batch_size
    reference = check.reference()
    rows = np.concatenate([np.arange(i * size, i * size + len(next(iter(o.values())))) for i, o in zip(picked, outs)])
    candidate = {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}
    expected = {name: array[rows] for name, array in reference.items()}
    inputs = {name: array[rows] for name, array in check.ctx.eval_set().arrays.items()}
    return compare(candidate, expected, inputs, check.ctx.tolerance, "input", check.ctx.recipe.evaluate.top1)


#: Fused attention ops (ONNX Runtime's contrib ops, ONNX's own since opset 23): attention without a Softmax node.
FUSED_ATTENTION = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention", "PackedMultiHeadAttention",
                   "QAttention", "DecoderAttention", "DecoderMaskedMultiHeadAttention", "SparseAttention")


def has_attention(model: ModelArtifact) -> bool:
    """A fused attention op, or a Softmax whose output reaches a MatMul within two nodes: scaled dot-product attention."""
    graph = model.load(with_weights=False).graph
    if any(node.op_type in FUSED_ATTENTION for node in graph.node):
        return True
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    frontier = [out for node in graph.node if node.op_type == "Softmax" for out in node.output]
    for _ in range(3):
        nxt = []
        for tensor in frontier:
            for node in consumers.get(tensor, []):
                if node.op_type == "MatMul":
                    return True
                nxt.extend(node.output)
        frontier = nxt
    return False


def _model_feeds(feeds: dict[str, np.ndarray], ov_model) -> dict[str, np.ndarray]:
    """Only the arrays the model takes (a data set may carry more, e.g. labels)."""
    names = {port.get_any_name() for port in ov_model.inputs}
    return {k: v for k, v in feeds.items() if k in names}


def _fake_quantize_count(ov_model) -> int:
    return sum(op.get_type_name() == "FakeQuantize" for op in ov_model.get_ops())


class _nncf_logs_to:
    """NNCF logs (and prints progress) on its own logger: keep them in the stage log."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.handler = logging.Handler()
        self.handler.emit = lambda record: log.log(record.levelno, "nncf: %s", record.getMessage())  # type: ignore[method-assign]

    def __enter__(self):
        nncf_log = logging.getLogger("nncf")
        self.saved = nncf_log.propagate, list(nncf_log.handlers)
        nncf_log.handlers = [self.handler]
        nncf_log.propagate = False
        return self

    def __exit__(self, *exc):
        nncf_log = logging.getLogger("nncf")
        nncf_log.propagate, nncf_log.handlers = self.saved[0], self.saved[1]
        return False
