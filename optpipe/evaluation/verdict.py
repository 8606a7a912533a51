"""What a stage's numbers are worth: the warnings that keep an "ok" honest.

- coverage: the precision mix a stage computes in (optpipe.graph.coverage); a quantization
  stage with most of its MACs still in float warns, naming the op types it could not handle;
  any stage with compute nodes whose MACs could not be counted (shapes unknown) warns too;
- input sensitivity: an evaluation set on which the reference barely changes from sample to
  sample makes every accuracy figure meaningless (see optpipe.evaluation.accuracy).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from optpipe.core.artifact import ModelArtifact
from optpipe.evaluation.openvino_runtime import INT8_PRECISIONS
from optpipe.graph.coverage import Coverage, precision_coverage, quantization_warning, unknown_shapes_warning

if TYPE_CHECKING:
    from optpipe.cache.store import StageCache

#: Passes whose job is to move compute to int8: they warn when most of it stayed in float.
QUANTIZATION_PASSES = ("int8", "nncf", "openvino-int8", "weight_only")

log = logging.getLogger("optpipe.verdict")


#: An OpenVINO int8 stage warns below this share of int8 compute layers (its runtime counts layers, not MACs).
INT8_LAYER_SHARE_MIN = 0.5

#: Bump when precision_coverage's figures change: cached coverages of older formats are not reused.
COVERAGE_FORMAT = 4  # 4: MatMulNBits in int4/int8 (MACs and packed bytes), a weight-bytes mix; 2: fused attention split (projection / scores and context), QAttention & co. counted; 3: FusedMatMul on a rank-2 weight


def stage_coverage(artifact: ModelArtifact, dims: dict[str, int], pass_name: str,
                   excluded: list[str] | None = None, cache: "StageCache | None" = None) -> tuple[Coverage | None, list[str]]:
    """The stage's precision mix and, for a quantization stage, the warning when it mostly stayed in float.

    `cache`: where the figures of a model already counted are kept. Counting needs shape inference
    (ORT's symbolic one imports torch): a cached rerun reads them instead.
    """
    if not artifact.path.is_file():  # an OpenVINO IR: no ONNX to count MACs on; a pass that counted its weights says so
        counted = artifact.info.get("coverage")
        coverage = Coverage.model_validate(counted) if isinstance(counted, dict) else None
        return coverage, [w for w in (openvino_int8_warning(artifact.info), ignored_params_warning(artifact.info),
                                      guard_gave_up_warning(artifact.info), *pass_warnings(artifact.info)) if w]
    key = cache.key(coverage=COVERAGE_FORMAT, model=artifact.content_hash(), dims=dims, excluded=sorted(excluded or ())) if cache else None
    hit = cache.get_result(key) if cache else None
    if hit is not None:
        coverage = Coverage.model_validate(hit)
    else:
        try:
            coverage = precision_coverage(artifact.load(with_weights=False), dims, excluded=set(excluded or ()))
        except Exception as exc:  # a graph shape inference cannot read: the report says so, the run goes on
            log.warning("precision coverage not computed: %s", exc)
            return None, []
        if cache:
            cache.put_result(key, coverage.model_dump(mode="json"))
    warnings = [w for w in (unknown_shapes_warning(coverage), *pass_warnings(artifact.info)) if w]
    if pass_name in QUANTIZATION_PASSES:
        warning = quantization_warning(coverage)
        if warning:
            warnings.append(warning)
    return coverage, warnings


def export_refusal(stage, allow_out_of_tolerance: bool) -> tuple[str | None, list[str]]:
    """Why exporting this stage (a metrics.StageResult) needs the user's say-so, and the warnings to print.

    An out-of-tolerance stage is refused unless allowed; allowed, it is exported with a warning,
    as is any stage whose report carries warnings (float coverage, meaningless accuracy).
    """
    warnings = list(stage.warnings)
    accuracy = stage.accuracy
    if accuracy is not None and not accuracy.within_tolerance:
        why = "; ".join(accuracy.violations) or "out of tolerance"
        if not allow_out_of_tolerance:
            return (f"--stage: '{stage.name}' is out of tolerance ({why}); pick a stage within tolerance "
                    "or pass --allow-out-of-tolerance"), warnings
        warnings.insert(0, f"'{stage.name}' is out of tolerance: {why}")
    return None, warnings


def openvino_int8_warning(info: dict) -> str | None:
    """An OpenVINO stage asked for int8 whose compiled model runs most of its compute layers
    (MatMul, Convolution, ...) in float: the runtime's own account (int8_layers), not NNCF's plan."""
    layers = info.get("compute_layer_precisions")
    if info.get("precision") != "int8" or layers is None:
        return None
    total, int8 = sum(layers.values()), info.get("int8_layers", 0)
    if not total and info.get("ir_compute_ops"):
        # At static shapes the CPU plugin may fuse a graph into Snippets subgraphs, which report one precision.
        return (f"asked for int8, but the CPU plugin runs its {info['ir_compute_ops']} MatMul / Convolution ops inside fused "
                f"subgraphs it reports at {info.get('inference_precision', 'f32')}: no int8 kernel is confirmed")
    if not total:
        return "asked for int8, but the model has no MatMul or Convolution layer: nothing was quantized, it runs in float"
    if int8 / total >= INT8_LAYER_SHARE_MIN:
        return None
    quantizers = (info.get("int8") or {}).get("quantizers")
    placed = f" (NNCF placed {quantizers} quantizers)" if quantizers is not None else ""
    return (f"asked for int8, but only {int8} of {total} compute layers run int8{placed}; "
            f"the rest run in {', '.join(sorted(p for p in layers if p not in INT8_PRECISIONS))}")


def pass_warnings(info: dict) -> list[str]:
    """What a pass's info says that its figures do not: ranges calibrated on made-up data, a guard
    that kept every converted node in float (the stage is its input model)."""
    warnings = list(info.get("source_warnings") or [])  # the export's: checkpoint weights left out or made up
    if info.get("samples_mixed"):  # the export's: eager on one sample alone against its row in a batch
        warnings.append(mixed_samples_warning(info["samples_mixed"]))
    calibration = info.get("calibration") or (info.get("int8") or {}).get("calibration") or {}
    if isinstance(calibration, dict) and calibration.get("source") == "synthetic":
        warnings.append("int8 ranges were calibrated on synthetic data (uniform in each input's `range`, "
                        "U(-1,1) by default): real inputs outside those ranges clip; calibrate on real samples "
                        "(data.calibration with a path)")
    guard = info.get("guard") or {}
    if isinstance(guard, dict) and guard.get("unconverted"):
        warnings.append(f"guard: {guard['unconverted']}")
    elif info.get("op_changes") == {} and info.get("mode") in ("dynamic", "static"):
        warnings.append(_nothing_quantized(info))
    if info.get("algorithm") == "awq" and info.get("int4_matmuls") == 0:
        warnings.append(f"awq: NNCF put no MatMul in INT4 (ratio {info.get('ratio')}, block_size {info.get('block_size')}); "
                        "every weight is at 8 bits, round-to-nearest: raise `ratio`, or use a `block_size` that divides "
                        "the MatMuls' input width")
    return warnings


def mixed_samples_warning(mixed: dict) -> str:
    """The export's finding that the first dim is not a batch of independent samples (passes/_eager_reference.py)."""
    return (f"the first dim is not a batch of independent samples: {mixed['why']}. Its figures at batch N do not hold "
            "for N separate requests, and the Triton target serves it unbatched; if the first dim is not the batch, put the "
            "batch first in the model and in `inputs`")


def guard_gave_up_warning(info: dict) -> str | None:
    """An int8 stage whose accuracy repair ran out of its time budget (openvino's guard_budget_s): what it kept."""
    guard = (info.get("int8") or {}).get("guard") or {}
    return f"int8 guard stopped: {guard['gave_up']}" if guard.get("gave_up") else None


def ignored_params_warning(info: dict) -> str | None:
    """Params the stage set that its precision does not read (an OpenVINO fp32 stage with exclude_types):
    the stage is not the mix the recipe seems to ask for."""
    ignored = info.get("ignored_params")
    if not ignored:
        return None
    verb, them = ("applies", "it") if len(ignored) == 1 else ("apply", "them")
    why = info.get("ignored_why", "only to precision int8")
    return f"{', '.join(ignored)} {verb} {why}; this {info.get('precision')} stage ignored {them}"


def _nothing_quantized(info: dict) -> str:
    """The int8 pass changed no op: its precision column reads fp32 100% with nothing in it to say why. A graph whose
    compute sits in Loop / If / Scan bodies (a scripted loop) is the case met: ORT's quantizer leaves subgraphs alone."""
    nested = sorted(set((info.get("graph") or {}).get("ops") or {}) & {"Loop", "If", "Scan"})
    why = (f": its compute is inside {'/'.join(nested)} bodies, which ONNX Runtime's quantizer leaves in float" if nested
           else f": the graph holds none of the ops it quantizes ({', '.join(info.get('op_types') or [])})")
    return f"int8 quantized no node{why}; this stage is its input model"


def flag_unchanged_stages(results: list, stages: dict, cache: "StageCache | None" = None) -> None:
    """Warn on each of `results` whose model is its parent's: same file, or same ops with the same weights.

    `stages`: stage name -> its StageResult (with `.model`), where the parents are found.
    `cache`: where the answer for a pair of models already compared is kept (comparing the weights
    reads both models whole).
    """
    for result in results:
        parent = stages.get(result.parent or "")
        if result.status != "ok" or result.model is None or parent is None or parent.model is None:
            continue
        if _same_model_cached(result.model, parent.model, cache):
            result.warnings.insert(0, f"this stage changed nothing: its model computes exactly what "
                                      f"'{result.parent}' does (same ops, same weights)")


def _same_model_cached(a: ModelArtifact, b: ModelArtifact, cache: "StageCache | None") -> bool:
    if cache is None:
        return same_model(a, b)
    key = cache.key(same_model=1, models=[a.content_hash(), b.content_hash()])
    hit = cache.get_result(key)
    if hit is None:
        hit = {"same": same_model(a, b)}
        cache.put_result(key, hit)
    return bool(hit["same"])


def same_model(a: ModelArtifact, b: ModelArtifact) -> bool:
    """The same file, or (written anew) the same op histogram and byte-identical weights."""
    from optpipe.graph.stats import op_histogram

    if a.content_hash() == b.content_hash():
        return True
    if not (a.path.is_file() and b.path.is_file()):
        return False  # another format (an OpenVINO IR beside its ONNX parent): a conversion, not a no-op
    if op_histogram(a.load(with_weights=False)) != op_histogram(b.load(with_weights=False)):
        return False
    return _weights_digest(a) == _weights_digest(b)


def _weights_digest(artifact: ModelArtifact) -> list[str]:
    import hashlib

    from onnx import numpy_helper

    return sorted(hashlib.sha256(numpy_helper.to_array(init).tobytes()).hexdigest() for init in artifact.load().graph.initializer)


def left_in_float(stages: list) -> list[str]:
    """One line per quantization stage that left compute in float: which ops, how much, and why."""
    lines = []
    for s in stages:
        if s.pass_name in QUANTIZATION_PASSES and s.coverage and s.coverage.float_compute:
            lines.append(f"`{s.name}` ({s.coverage.share('int8'):.0%} of MACs in int8): {s.coverage.float_ops_text(limit=6)}")
    return lines


#: The reference export's line when PyTorch eager disagrees with it on the evaluation data (verdict: out of tolerance).
UNFAITHFUL_EXPORT = "does not compute what PyTorch eager does on the evaluation data"


def flag_unfaithful_reference(stages: list, reference: str | None) -> str | None:
    """Where PyTorch eager's row found that the reference export does not compute what the model does on the evaluation
    data (`Accuracy.export_mismatch`), every stage is out of tolerance: the export by that mismatch, the others because
    their figures are against it. Its self-check held on the recipe's synthetic inputs, so the export and every
    stage after it read "ok" at cosine 1.0 while computing something else (a model that divides images by 255 when
    their max is over 1, traced on [-1, 1]: eager's row alone said cosine -0.50). Returns the warning (None: nothing
    to flag); idempotent (the in-process evaluation and the report both call it)."""
    eager = next((s for s in stages if s.pass_name == "eager" and s.accuracy is not None), None)
    why = eager.accuracy.export_mismatch if eager is not None else None
    if not why or reference is None:
        return None
    for stage in stages:
        if stage.pass_name == "eager" or stage.status != "ok" or stage.accuracy is None:
            continue
        violation = (f"{UNFAITHFUL_EXPORT} ({why})" if stage.name == reference
                     else f"measured against '{reference}', which {UNFAITHFUL_EXPORT}")
        if violation not in stage.accuracy.violations:
            stage.accuracy.within_tolerance = False
            stage.accuracy.violations.insert(0, violation)
    ref = next((s for s in stages if s.name == reference), None)
    warning = unfaithful_export_warning(reference, why, ref.info if ref is not None else {})
    if ref is not None and warning not in ref.warnings:
        ref.warnings.append(warning)
    return warning


def unfaithful_export_warning(reference: str, why: str, info: dict) -> str:
    """What to change when the export computes something else than the model on the user's data."""
    branches = info.get("trace_branches") or []
    if branches:
        cause = (f"the TorchScript trace recorded one branch of forward()'s control flow on tensor values (the tracer: "
                 f"'{branches[0]}'), the branch the synthetic trace inputs of `inputs` took: give those inputs a `range` "
                 "like the data's so the trace takes its branch, or write the branch with torch.where")
    else:
        cause = "its self-check passed on the synthetic inputs of `inputs` only: give them a `range` like the data's"
    return (f"'{reference}' {UNFAITHFUL_EXPORT} ({why}); every stage is measured against it, so none is within "
            f"tolerance: {cause}")
