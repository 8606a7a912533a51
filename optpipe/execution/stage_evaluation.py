"""Stage evaluation: every finished stage measured on the same inputs against the reference
stage's outputs, plus the PyTorch eager baseline. A failed measurement marks its stage
failed with the reason; it never stops the run."""
from __future__ import annotations

import logging
from typing import Callable

from optpipe.cache.store import StageCache
from optpipe.execution.interrupt import escalate
from optpipe.errors import OptpipeError, first_line
from optpipe.evaluation.evaluator import Evaluator
from optpipe.evaluation.guard import fold_guard_verdict
from optpipe.evaluation.verdict import stage_coverage
from optpipe.execution.services import RunServices
from optpipe.execution.stage_runner import StageOutcome
from optpipe.results import StageResult
from optpipe.model_source import source_fingerprint
from optpipe.recipe import OnnxModel, Recipe

EAGER_STAGE = "pytorch-eager"

Notify = Callable[..., None]


def evaluate_stages(
    recipe: Recipe,
    order: list[str],
    outcomes: dict[str, StageOutcome],
    services: RunServices,
    cache: StageCache,
    providers: str,
    notify: Notify,
    force: bool = False,
) -> list[StageResult]:
    """Measure every finished stage on the same inputs; the reference stage's outputs are the yardstick."""
    evaluator = Evaluator(recipe, cache, services.eval_set, providers, progress=lambda *a: notify("step", *a), force=force)
    reference = recipe.evaluate.reference or next(n for n in order if recipe.stages[n].after is None)
    ref_outcome = outcomes.get(reference)
    if ref_outcome is not None and ref_outcome.status == "ok":
        artifact = ref_outcome.artifact
        evaluator.set_reference(reference, artifact.content_hash(), lambda: evaluator.onnx_outputs(artifact))

    results = []
    if recipe.evaluate.eager_baseline and not isinstance(recipe.model, OnnxModel):
        results.append(_evaluate_eager(recipe, evaluator, services, notify))
    for name in order:
        results.append(_evaluate_stage(name, recipe, outcomes[name], evaluator, notify))
    return results


def _evaluate_stage(name: str, recipe: Recipe, outcome: StageOutcome, evaluator: Evaluator, notify: Notify) -> StageResult:
    spec = recipe.stages[name]
    result = StageResult(
        name=name,
        pass_name=spec.pass_name,
        parent=spec.after,
        status=outcome.status,
        cached=outcome.cached,
        reason=outcome.reason,
        duration_s=round(outcome.duration_s, 3),
    )
    if outcome.status != "ok":
        return result
    artifact = outcome.artifact
    result.hash = artifact.content_hash()
    result.size_bytes = artifact.size_bytes()
    result.info = artifact.info
    dims = {dim: spec_.opt for dim, spec_ in recipe.dims.items()}
    result.coverage, result.warnings = stage_coverage(artifact, dims, spec.pass_name, artifact.info.get("excluded"))
    notify("stage_start", f"evaluate {name}", "accuracy and latency")
    try:
        accuracy, latency, memory, cached = evaluator.evaluate_onnx(artifact, recipe.tolerance_for(name))
    except OptpipeError as exc:
        escalate(exc, evaluator.cache.root)  # a Ctrl-C or a full disk behind it stops the run
        return _evaluation_failed(result, str(exc), notify)
    except Exception as exc:  # ORT refusing a graph, a shape mismatch: the stage is unusable, say why
        escalate(exc, evaluator.cache.root)
        logging.getLogger("optpipe").debug("evaluation of %s failed", name, exc_info=True)
        return _evaluation_failed(result, f"evaluation failed: {type(exc).__name__}: {first_line(exc)}", notify)
    result.accuracy, result.latency, result.memory = fold_guard_verdict(accuracy, artifact.info), latency, memory
    result.warnings += accuracy.warnings if accuracy else []
    result.cached = result.cached and cached
    notify("stage_end", f"evaluate {name}", "cached" if cached else "ok", _summary(result))
    return result


def _evaluate_eager(recipe: Recipe, evaluator: Evaluator, services: RunServices, notify: Notify) -> StageResult:
    result = StageResult(name=EAGER_STAGE, pass_name="eager", status="ok")
    notify("stage_start", f"evaluate {EAGER_STAGE}", "accuracy and latency")
    try:
        digest = StageCache.key(source=source_fingerprint(recipe), inputs=[s.model_dump() for s in recipe.inputs])
        accuracy, latency, memory, cached = evaluator.evaluate_eager(services.torch_model, digest, recipe.evaluate.tolerance)
    except OptpipeError as exc:
        escalate(exc, evaluator.cache.root)  # a Ctrl-C or a full disk behind it stops the run
        return _evaluation_failed(result, str(exc), notify)
    except Exception as exc:  # the baseline is informative; its failure must not stop the run
        escalate(exc, evaluator.cache.root)
        return _evaluation_failed(result, f"PyTorch eager baseline failed: {type(exc).__name__}: {first_line(exc)}", notify)
    result.accuracy, result.latency, result.memory, result.cached = accuracy, latency, memory, cached
    result.warnings += accuracy.warnings if accuracy else []
    notify("stage_end", f"evaluate {EAGER_STAGE}", "cached" if cached else "ok", _summary(result))
    return result


def _evaluation_failed(result: StageResult, reason: str, notify: Notify) -> StageResult:
    result.status = "failed"
    result.reason = reason
    notify("stage_end", f"evaluate {result.name}", "failed", reason)
    return result


def _summary(result: StageResult) -> str:
    parts = []
    if result.headline:
        parts.append(f"p50 {result.headline.p50_ms:.2f} ms @ batch {result.headline.batch_size}")
    if result.accuracy:
        parts.append(f"cosine {result.accuracy.worst_cosine:.5f}")
        if not result.accuracy.within_tolerance:
            parts.append("OUT OF TOLERANCE")
    if result.coverage:
        parts.append(result.coverage.summary())
    parts += [f"WARNING: {w}" for w in result.warnings]
    return ", ".join(parts)
