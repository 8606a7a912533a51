"""openvino: the stage's ONNX as an OpenVINO IR, in FP32, BF16 or INT8 (NNCF post-training quantization).

The output is an IR stage (`model.xml` + `model.bin` + `openvino.json`, the compile settings it
is measured and deployed with); every later measurement of it runs on OpenVINO's CPU runtime.
No ONNX pass can follow it.

- fp32 / bf16: the input ONNX read by OpenVINO's ONNX frontend (`Core.read_model`); the same IR, compiled with
  INFERENCE_PRECISION_HINT f32 or bf16 (bf16 only where the CPU plugin lists BF16).
- int8: `nncf.quantize` on the cached calibration set (NNCF's TRANSFORMER model type where the
  graph has attention), FakeQuantize ops in the IR that the CPU plugin runs as int8 kernels.
  Guard: the result is compared with the input ONNX (run by ONNX Runtime) on the evaluation set;
  when it breaks the stage's tolerance, `nncf.quantize_with_accuracy_control` re-quantizes,
  reverting the quantizers that cost the most (up to `max_excluded`) until the cosine holds.

NNCF's part (quantize, the ignored scope, the guard) is in passes/_openvino_nncf.py.

The stage info records the precision the compiled model really runs at (its
INFERENCE_PRECISION_HINT and the number of layers per runtime precision).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field

from optpipe.core.artifact import ModelArtifact, write_info
from optpipe.core.errors import DataError, PassError
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.evaluation.guard_types import guard_criteria
from optpipe.core.results import Accuracy
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams
from optpipe.passes._openvino_input import openvino_model
from optpipe.passes._openvino_isa import bf16_skip_reason, int8_skip_reason
from optpipe.passes._openvino_guard import against_input
from optpipe.passes._openvino_nncf import quantize

class OpenVinoParams(PassParams):
    precision: Literal["fp32", "bf16", "int8"] = Field("fp32", description="fp32 / bf16 (inference precision hint) or int8 (NNCF)")
    model_type: Literal["auto", "transformer", "other"] = Field(
        "auto", description="int8: NNCF's TRANSFORMER model type; auto: when the graph has attention (Softmax feeding MatMul)"
    )
    preset: Optional[Literal["performance", "mixed"]] = Field(
        None, description="int8: NNCF preset (mixed: asymmetric activations); default NNCF's choice for the model type "
        "(mixed for transformers), but performance for a transformer on an AMX CPU (measured faster there)"
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
    guard_budget_s: float = Field(120.0, gt=0, description="guard: seconds the repair of a plain INT8 result that breaks the "
                                  "tolerance may take (cheap fixes, then NNCF's accuracy control); then it stops, keeps the "
                                  "best result so far and says so")
    skip_slow: bool = Field(True, description="int8 / bf16: skip the stage where OpenVINO was measured slower at that precision "
                            "than at FP32 (int8: x86 without VNNI or AVX-512; bf16: without AVX-512 BF16 or AMX); false: build it anyway "
                            "(e.g. for a deployment CPU of another class)")


#: Params that only the int8 path reads: set on an fp32 / bf16 stage, they change nothing (the report says so).
INT8_ONLY = frozenset({"model_type", "preset", "subset_size", "fast_bias_correction", "smooth_quant_alpha", "exclude",
                       "exclude_types", "guard", "max_excluded", "guard_budget_s"})


class OpenVinoPass(Pass):
    """Convert to OpenVINO IR (FP32, BF16 or NNCF INT8), measured on OpenVINO's CPU runtime."""

    name = "openvino"
    # 2: an exclude_types entry that is no op type of the IR is refused (a cached 1 may hold a stage that excluded nothing)
    # 3: an exclude entry takes every IR op converted from that ONNX node (a cached 2 kept only the op named exactly so);
    #    the info records ignored int8-only params and the IR's compute ops
    # 4: the guard holds the whole tolerance (top-1, max_abs), not the cosine alone
    # 5: an FP32 conversion that breaks the tolerance is refused; fused attention ops make the graph a transformer
    # 6: a smooth_quant_alpha NNCF ignores (no transformer) is recorded
    # 7: the guard tries cheap fixes first (the worst MatMuls in float, the other preset) within guard_budget_s
    # 8: the CPU class OpenVINO runs at joins the key (isa_dependent); NNCF's overflow fix in every layer where
    #    int8 sums saturate (x86 without VNNI)
    # 9: the ONNX read by Core.read_model (memory-mapped weights) instead of convert_model
    # 10: a transformer's int8 on AMX takes NNCF's performance preset (symmetric activations), where the recipe
    #     names none (passes/_openvino_isa.int8_preset); the info records the preset and who chose it
    # 11: the guard's cheap fix keeps convolutions in float as well as MatMuls (a CNN had none), and it and NNCF's
    #     accuracy control judge by the recipe's task as the stage's verdict does; of tries that all miss, the one kept
    #     is the nearest to the verdict (guard_types.attempt_score), not the one of highest cosine
    version = "11"
    Params = OpenVinoParams
    # The int8 guard, NNCF's accuracy control and its statistics run on OpenVINO: their decisions hold for the
    # class OpenVINO ran at (ONEDNN_MAX_CPU_ISA included), and a shared cache must not hand them to another.
    isa_dependent = True
    isa_engine = "openvino"
    libraries = ("onnx", "openvino", "nncf")
    produces = "openvino-ir"  # no ONNX pass may follow this stage (optpipe.plan.validate)

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
        return {"guard": guard_criteria(ctx)}

    def skip_reason(self, ctx: PassContext) -> str | None:
        """int8 / bf16 where OpenVINO runs them slower than fp32 on this CPU class (passes/_openvino_isa.py)."""
        params: OpenVinoParams = self.params  # type: ignore[assignment]
        if not params.skip_slow or params.precision == "fp32":
            return None
        return int8_skip_reason() if params.precision == "int8" else bf16_skip_reason()

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params: OpenVinoParams = self.params  # type: ignore[assignment]
        if not ovr.supports(params.precision):
            raise PassError(f"this CPU cannot run bf16 in OpenVINO (its capabilities: {', '.join(ovr.cpu_capabilities())}); "
                            "use precision fp32 or int8")
        with openvino_model(model, ctx) as (converted, rewritten):  # memory-mapped weights (openvino_runtime.read_onnx)
            return self._convert(converted, model, ctx, {"runtime": ovr.RUNTIME, "precision": params.precision, **rewritten})

    def _convert(self, converted, model: ModelArtifact, ctx: PassContext, info: dict[str, Any]) -> ModelArtifact:
        params: OpenVinoParams = self.params  # type: ignore[assignment]
        check = InputCheck(model, ctx)
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
            if params.precision == "fp32":
                accuracy = check.conversion(converted)
            else:
                # As for int8: a bf16 result within tolerance vouches for the FP32 translation it is compiled
                # from (the same IR); one that breaks it may be a broken conversion, checked then. It repeated
                # ov-fp32's very check (compile, 64 samples, compare: 4.1 s of a loaded cold compile, cProfile).
                accuracy = check(result, ovr.PRECISION_HINTS[params.precision])
                if not accuracy.within_tolerance:
                    check.conversion(converted)
        ovr.save_ir(result, ctx.workdir)
        hint = ovr.write_settings(ctx.workdir, params.precision)["hint"]
        # The check compiled this very ov.Model at this hint (the same compile_config): its runtime graph
        # is the one to read the precision facts from; a second compile cost 0.3-1 s per stage.
        compiled = check.compiled_as(result, hint) or ovr.compile_model(ctx.workdir / ovr.IR_FILE, ctx.evaluate.threads, hint)
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
        self._reference = self._reference_batches = None
        self._compiled = None  # (ov.Model, hint, compiled model) of the last check

    @property
    def batch_size(self) -> int:
        """The evaluation's accuracy batch (a model without a batch dim: its fixed one), as the guard's."""
        from optpipe.evaluation.guard import accuracy_batch

        return accuracy_batch(self.ctx.inputs, self.ctx.evaluate)

    @property
    def batches(self) -> list[dict[str, np.ndarray]]:
        size, samples = self.batch_size, self.ctx.eval_set()
        if not self.ctx.inputs.batch_dim() and len(samples) % size:
            # The IR (and ONNX Runtime) refuse a partial batch of a fixed-batch model: the data's fault, said so.
            raise DataError(f"data.eval: {len(samples)} samples do not fill whole batches of the model's fixed batch {size}; "
                            f"give a multiple of {size}")
        return list(samples.batches(size))

    def reference(self):
        if self._reference is None:
            from optpipe.evaluation.accuracy import run_onnx

            self._reference = run_onnx(self.model.path, self.batches, self.ctx.evaluate.threads)
        return self._reference

    def reference_batches(self) -> list[dict[str, np.ndarray]]:
        """The input's outputs batch by batch, for outputs that are not one row per sample (subset_accuracy)."""
        if self._reference_batches is None:
            from optpipe.core.runtime import ort_runner, ort_session

            run = ort_runner(ort_session(self.model.path, self.ctx.evaluate.threads))
            self._reference_batches = [run(feeds) for feeds in self.batches]
        return self._reference_batches

    def outputs(self, compiled) -> dict[str, np.ndarray]:
        from optpipe.evaluation.accuracy import run_callable

        return run_callable(ovr.runner(compiled, self.names), self.batches)

    def compare(self, outputs) -> Accuracy:
        return against_input(self.ctx, outputs, self.reference())

    def __call__(self, ov_model, hint: str = "f32") -> Accuracy:
        compiled = ovr.compile_model(ov_model, self.ctx.evaluate.threads, hint)
        self._compiled = (ov_model, hint, compiled)
        return self.compare(self.outputs(compiled))

    def compiled_as(self, ov_model, hint: str):
        """The model the last check compiled, if it was this ov.Model (the same object) at this hint; else None."""
        if self._compiled and self._compiled[0] is ov_model and self._compiled[1] == hint:
            return self._compiled[2]
        return None

    def conversion(self, converted) -> Accuracy:
        return check_conversion(converted, self.model, self)


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
