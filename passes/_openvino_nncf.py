"""INT8 through NNCF for the openvino pass (passes/openvino.py): post-training quantization on the
cached calibration set, the ignored scope built from the recipe's names and types, and the guard
(NNCF's accuracy-controlled quantization holding the stage's tolerance).

A module of its own (the registry skips `_` modules): the pass's conversion and checks stay in
openvino.py, what NNCF needs of them comes in as the `InputCheck` the pass built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from optpipe.core.artifact import ModelArtifact
from optpipe.core.errors import PassError, RecipeError, first_line
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.passes._calibration_feeds import calibration_feeds
from optpipe.passes._openvino_guard import fake_quantize_count, repair, model_feeds, nncf_logs_to
from optpipe.passes._openvino_isa import int8_preset
from optpipe.hardware.cpu_features import engine_target, int8_sums_saturate

if TYPE_CHECKING:
    from optpipe.pass_infra.pass_base import PassContext
    from optpipe.passes.openvino import InputCheck, OpenVinoParams


def quantize(converted, model: ModelArtifact, params: OpenVinoParams, ctx: PassContext, check: InputCheck):
    """NNCF post-training quantization, then the guard's bounded repair (passes/_openvino_guard.py) when the
    plain result breaks the tolerance."""
    nncf = ovr.nncf()

    check_exclude_types(params, converted, ctx.stage)
    calibration = calibration_batches(ctx, converted)
    options, preset = nncf_options(params, model, len(calibration), exclude_names(params, model, converted, ctx.stage))
    ctx.log.info("nncf.quantize with %s", {k: str(v) for k, v in options.items()})
    with nncf_logs_to(ctx.log):
        try:
            quantized = nncf.quantize(converted, nncf.Dataset(calibration, _ticking(ctx, len(calibration))), **options)
        except Exception as exc:
            raise PassError(f"NNCF quantization failed: {first_line(exc)}; try `exclude_types` or precision fp32") from None
    ctx.progress("int8: check against the input", 0, 1)
    accuracy = check(quantized)
    steps = [{"method": "nncf.quantize", "cosine": accuracy.worst_cosine, "held": accuracy.within_tolerance,
              "quantizers": fake_quantize_count(quantized)}]
    if not accuracy.within_tolerance:
        # An int8 result within tolerance vouches for the conversion too (3 s of a MiniLM compile
        # saved); one that breaks it may be a broken conversion, which no excluded node can mend.
        check.conversion(converted)
    not_run = gave_up = None
    if not accuracy.within_tolerance and params.guard and params.max_excluded and ctx.tolerance.cosine_min:
        ctx.log.info("plain INT8 broke the tolerance (%s): repairing within %g s", "; ".join(accuracy.violations),
                     params.guard_budget_s)
        quantized, accuracy, repairs, gave_up = repair(converted, quantized, accuracy, calibration, options, params, ctx, check)
        steps += repairs
    elif not accuracy.within_tolerance and params.guard:
        # The repair holds one metric against the bound: optpipe's cosine. Without one, say so.
        not_run = "the tolerance has no cosine_min for the guard to hold" if not ctx.tolerance.cosine_min \
            else "max_excluded is 0"
        ctx.log.warning("openvino int8 guard not run: %s", not_run)
    details = {
        "options": {k: str(v) for k, v in options.items()},
        "preset": preset,
        "calibration_samples": options["subset_size"],
        "calibration": {"source": ctx.calibration_set().origin},  # the set is built once per content: a cache read
        "quantizers": fake_quantize_count(quantized),
        "guard": {"enabled": params.guard, "held": accuracy.within_tolerance, "cosine": accuracy.worst_cosine,
                  "violations": accuracy.violations, "steps": steps, "not_run": not_run,
                  "gave_up": gave_up, "budget_s": params.guard_budget_s},
    }
    return quantized, accuracy, details


def preset_choice(params: OpenVinoParams, transformer: bool) -> dict[str, str]:
    """Which NNCF preset quantizes the model and who chose it: the recipe, this CPU class where NNCF's default does
    not fit it (passes/_openvino_isa.int8_preset), or NNCF's default for the model type (what NNCF itself takes when
    given none: mixed for its TRANSFORMER type, performance otherwise). Always given to NNCF, so the guard's other
    preset (passes/_openvino_guard.py) is the one not in the options."""
    if params.preset:
        return {"preset": params.preset, "chosen_by": "the recipe"}
    if (choice := int8_preset(transformer)) is not None:
        return {"preset": choice[0], "chosen_by": f"this CPU class ({engine_target('openvino').cpu_class}): {choice[1]}"}
    return {"preset": "mixed" if transformer else "performance", "chosen_by": "NNCF's default for the model type"}


def calibration_batches(ctx: PassContext, converted) -> list[dict[str, np.ndarray]]:
    """The calibration set in batches the converted model takes (passes/_calibration_feeds.py), fed by its names."""
    return [model_feeds(feeds, converted) for feeds in calibration_feeds(ctx, ovr.input_shapes(converted))]


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


def nncf_options(params: OpenVinoParams, model: ModelArtifact, samples: int,
                 exclude: list[str] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """NNCF's quantize() options, and the preset record (preset_choice) the stage info keeps."""
    nncf = ovr.nncf()

    transformer = params.model_type == "transformer" or (params.model_type == "auto" and has_attention(model))
    options: dict[str, Any] = {
        "subset_size": min(params.subset_size, samples),
        "fast_bias_correction": params.fast_bias_correction,
        "model_type": nncf.ModelType.TRANSFORMER if transformer else None,
    }
    preset = preset_choice(params, transformer)
    options["preset"] = nncf.QuantizationPreset(preset["preset"])
    if exclude or params.exclude_types:
        # Every name and type was matched against the IR already (exclude_names, check_exclude_types).
        options["ignored_scope"] = nncf.IgnoredScope(names=list(exclude), types=list(params.exclude_types), validate=False)
    advanced: dict[str, Any] = {}
    if params.smooth_quant_alpha is not None:
        advanced["smooth_quant_alphas"] = nncf.AdvancedSmoothQuantParameters(matmul=params.smooth_quant_alpha)
    if int8_sums_saturate(engine_target("openvino")):
        # Without VNNI oneDNN sums u8 x s8 pairs in saturating int16: NNCF's default fixes that in the first
        # layer only. Measured under ONEDNN_MAX_CPU_ISA=AVX2 on the attention test graph: cosine 0.967
        # (worst row 0.40) with the default, 0.998 (0.90) with ENABLE (7-bit weights in every layer), as uncapped.
        advanced["overflow_fix"] = nncf.OverflowFix.ENABLE
    if advanced:
        options["advanced_parameters"] = nncf.AdvancedQuantizationParameters(**advanced)
    return options, preset


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


def _ticking(ctx: PassContext, total: int):
    """NNCF's data transform for calibration: each sample it reads is a progress tick (it reads the set once per
    statistics pass: the count starts again), so a long quantization is not a silent one."""
    seen = [0]

    def transform(item):
        seen[0] += 1
        ctx.progress("NNCF calibration", (seen[0] - 1) % total + 1, total)
        return item

    return transform


