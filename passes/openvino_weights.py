"""openvino_weights: the stage's ONNX as an OpenVINO IR with INT4 / INT8 weights (NNCF `compress_weights`).

Weight-only compression, the form OpenVINO GenAI and `optimum-cli export openvino --weight-format
int4` run: each MatMul's weight is stored in 4 or 8 bits, one scale (and, asymmetric, one zero
point) per `group_size` weights; the CPU plugin decompresses it inside its FullyConnected kernel
and computes with float (or, `activations: bf16`, bfloat16) activations. INT4 modes are mixed: NNCF
keeps the embeddings and the last MatMul in a backup precision (INT8_ASYM) unless `all_layers`,
and puts `ratio` of the other layers in 4 bits. With `data_aware`, the calibration set drives
NNCF's mixed-precision choice and, if asked, AWQ, scale estimation, GPTQ and LoRA correction.

Sits beside passes/openvino.py (FP32/BF16/INT8 activations): like it, the output is an IR stage
measured on OpenVINO's CPU runtime, and no ONNX pass can follow it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from optpipe.core.artifact import ModelArtifact, write_info
from optpipe.core.errors import PassError, first_line
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.graph.ir_weights import ir_coverage
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams
from optpipe.passes._openvino_input import openvino_model

MODES = {"int4_sym": "INT4_SYM", "int4_asym": "INT4_ASYM", "int8_sym": "INT8_SYM", "int8_asym": "INT8_ASYM"}
SENSITIVITY = {"weight_error": "WEIGHT_QUANTIZATION_ERROR", "hessian": "HESSIAN_INPUT_ACTIVATION", "mean_variance": "MEAN_ACTIVATION_VARIANCE",
               "max_variance": "MAX_ACTIVATION_VARIANCE", "mean_magnitude": "MEAN_ACTIVATION_MAGNITUDE"}
DATA_OPTIONS = ("awq", "scale_estimation", "gptq", "lora_correction")


class OpenVinoWeightsParams(PassParams):
    mode: Literal["int4_sym", "int4_asym", "int8_sym", "int8_asym"] = Field("int4_sym", description="NNCF weight compression mode")
    group_size: int = Field(128, ge=-1, description="int4: weights per scale along the input channels (-1: one per channel)")
    ratio: float = Field(1.0, gt=0, le=1, description="int4: share of the layers in 4 bits (the rest in int8_asym)")
    group_size_fallback: Literal["error", "adjust", "ignore"] = Field(
        "adjust", description="int4: a layer whose input channels group_size does not divide: adjust = a smaller group "
        "that does (NNCF's min 32), ignore = leave it in the backup precision, error = refuse")
    all_layers: bool = Field(False, description="int4: embeddings and the last MatMul in 4 bits too (default: int8)")
    data_aware: bool = Field(False, description="use data.calibration: NNCF picks the 4-bit layers by activation sensitivity")
    awq: bool = Field(False, description="data_aware: AWQ's activation-aware weight scaling")
    scale_estimation: bool = Field(False, description="data_aware: scale estimation (minimises each layer's output error)")
    gptq: bool = Field(False, description="data_aware: GPTQ (rounds each weight column against the error the previous ones left)")
    lora_correction: bool = Field(
        False, description="data_aware: low-rank float adapters beside each 4-bit layer, fitted to its quantization error")
    sensitivity_metric: Literal["weight_error", "hessian", "mean_variance", "max_variance", "mean_magnitude"] | None = Field(
        None, description="ratio < 1: how NNCF ranks the layers it keeps in the backup precision (default: NNCF's, by data_aware)")
    backup_mode: Literal["int8_asym", "int8_sym", "none"] = Field(
        "int8_asym", description="int4: the precision of the layers not in 4 bits (none: float)")
    subset_size: int = Field(32, ge=1, description="data_aware: calibration samples NNCF reads")
    activations: Literal["fp32", "bf16"] = Field(
        "fp32", description="the precision the CPU plugin computes activations in (INFERENCE_PRECISION_HINT)"
    )
    exclude: list[str] = Field(default_factory=list, description="IR op names kept in float (NNCF ignored scope)")

    @model_validator(mode="after")
    def _options_combine(self):
        """Options NNCF would refuse or ignore in this combination: refused at recipe read (exit 2), one line each."""
        int4_only = {"group_size", "ratio", "all_layers", "group_size_fallback", "backup_mode", "sensitivity_metric"} & self.model_fields_set
        if not self.mode.startswith("int4") and int4_only:
            raise ValueError(f"{', '.join(sorted(int4_only))} apply to int4 modes only (NNCF compresses int8 per channel); "
                             f"remove them or set `mode: int4_sym`")
        data_only = set(DATA_OPTIONS) & {k for k in self.model_fields_set if getattr(self, k)}
        if data_only and not self.data_aware:
            raise ValueError(f"{', '.join(sorted(data_only))} {'needs' if len(data_only) == 1 else 'need'} activations: "
                             "set `data_aware: true` (and data.calibration)")
        if self.sensitivity_metric not in (None, "weight_error") and not self.data_aware:
            raise ValueError(f"sensitivity_metric {self.sensitivity_metric} ranks layers by their activations: set "
                             "`data_aware: true` (and data.calibration), or use `weight_error`")
        if self.gptq and self.lora_correction:
            raise ValueError("NNCF does not combine gptq with lora_correction: keep one")
        if self.lora_correction and self.all_layers:
            # NNCF's LoRA correction fails on a 4-bit embedding (a KeyError 'node_embedding', nncf 3.4).
            raise ValueError("lora_correction cannot take the embeddings in 4 bits: set `all_layers: false`")
        if self.group_size == 0:
            raise ValueError("group_size 0 is not a group: give a positive size (e.g. 64, 128) or -1 for one scale per channel")
        return self


class OpenVinoWeightsPass(Pass[OpenVinoWeightsParams]):
    """Convert to OpenVINO IR with INT4/INT8 weights (NNCF compress_weights); activations stay float."""

    name = "openvino_weights"
    version = "2"  # 2: data-aware compression on weights stored [out, in] (scale estimation was broken without)
    # Data-aware compression (AWQ, scale estimation) collects its statistics by running the model on OpenVINO.
    isa_dependent = True
    isa_engine = "openvino"
    Params = OpenVinoWeightsParams
    libraries = ("onnx", "openvino", "nncf")
    produces = "openvino-ir"  # no ONNX pass may follow this stage (optpipe.plan.validate)
    calibration_use = ("OpenVINO weight compression with data_aware", "set `params: {data_aware: false}`")

    @property
    def needs_calibration(self) -> bool:
        return self.params.data_aware  # type: ignore[attr-defined]

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params: OpenVinoWeightsParams = self.params  # type: ignore[assignment]
        if params.activations == "bf16" and not ovr.supports("bf16"):
            raise PassError(f"this CPU cannot run bf16 in OpenVINO (its capabilities: {', '.join(ovr.cpu_capabilities())}); "
                            "set `activations: fp32`")
        # Not mapped: NNCF replaces the weights it compresses, and the map would keep every page it read.
        # A rewritten input (passes/_openvino_input.py) lives until the IR is written: weights are read when used.
        with openvino_model(model, ctx, mmap=False) as (converted, rewritten):
            compressed = compress(converted, params, ctx)
            del converted
            ovr.save_ir(compressed, ctx.workdir)
            coverage = ir_coverage(compressed)
            del compressed
        hint = ovr.write_settings(ctx.workdir, params.activations)["hint"]
        compiled = ovr.compile_model(ctx.workdir / ovr.IR_FILE, ctx.evaluate.threads, hint)
        info: dict[str, Any] = {
            "runtime": ovr.RUNTIME,
            "precision": params.activations,
            "weights": params.mode,
            "options": nncf_options(params),
            "coverage": coverage.model_dump(mode="json"),
            "output_names": ovr.output_names(model.path),
            **ovr.precision_facts(compiled),
            **rewritten,
        }
        del compiled
        return write_info(ctx.workdir, info)


def compress(converted, params: OpenVinoWeightsParams, ctx: PassContext):
    nncf = ovr.nncf()  # imported with its telemetry off (optpipe/evaluation/openvino_runtime.py)

    options = nncf_options(params)
    kwargs: dict[str, Any] = {key: value for key, value in options.items() if key != "mode"}
    kwargs["mode"] = getattr(nncf.CompressWeightsMode, options["mode"])
    if "backup_mode" in kwargs:
        kwargs["backup_mode"] = getattr(nncf.BackupMode, kwargs["backup_mode"])
    if "sensitivity_metric" in kwargs:
        kwargs["sensitivity_metric"] = getattr(nncf.SensitivityMetric, kwargs["sensitivity_metric"])
    if params.exclude:
        kwargs["ignored_scope"] = nncf.IgnoredScope(names=list(params.exclude), validate=True)
    if params.mode.startswith("int4"):
        from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

        kwargs.pop("group_size_fallback")
        kwargs["advanced_parameters"] = AdvancedCompressionParameters(
            group_size_fallback_mode=GroupSizeFallbackMode(params.group_size_fallback))
    if params.data_aware:
        # NNCF's data-aware algorithms expect nn.Linear's layout: GPTQ refuses another, and scale estimation
        # silently broke Gemma 3 270M without it (perplexity 1.4e9 against 1.18x eager with it; AWQ alike
        # either way). passes/_ov_weight_layout.py.
        from optpipe.passes._ov_weight_layout import weights_out_in

        from optpipe.passes._openvino_nncf import calibration_batches

        ctx.log.info("data-aware: %d MatMul weights stored [out, in] for NNCF", weights_out_in(converted))
        # The same batches the openvino pass calibrates on (one sample each), read from the cached set.

        kwargs["dataset"] = nncf.Dataset(calibration_batches(ctx, converted))
    try:
        with ovr.telemetry_off():
            return nncf.compress_weights(converted, **kwargs)
    except Exception as exc:  # NNCF raises assorted errors on graphs and options it cannot handle
        ctx.log.exception("NNCF weight compression failed")
        raise PassError(f"NNCF's compress_weights failed: {first_line(exc)}; check `exclude` names, or try another "
                        "`mode` / `group_size`") from None


def nncf_options(params: OpenVinoWeightsParams) -> dict[str, Any]:
    """The arguments given to nncf.compress_weights (recorded in the stage info)."""
    options: dict[str, Any] = {"mode": MODES[params.mode]}
    if params.mode.startswith("int4"):
        options.update(group_size=params.group_size, ratio=params.ratio, all_layers=params.all_layers,
                       group_size_fallback=params.group_size_fallback, backup_mode=params.backup_mode.upper())
        if params.sensitivity_metric:
            options["sensitivity_metric"] = SENSITIVITY[params.sensitivity_metric]
    if params.data_aware:
        options.update(subset_size=params.subset_size, **{name: getattr(params, name) for name in DATA_OPTIONS})
    return options


