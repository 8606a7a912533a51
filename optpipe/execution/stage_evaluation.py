"""Stage evaluation: every finished stage measured on the same inputs against the reference
stage's outputs, plus the PyTorch eager baseline. A failed measurement marks its stage
failed with the reason; it never stops the run."""
from __future__ import annotations

import logging

from optpipe.cache.store import StageCache
from optpipe.execution.interrupt import escalate
from optpipe.errors import OptpipeError, first_line
from optpipe.evaluation.evaluator import Evaluator
from optpipe.evaluation.guard import fold_guard_verdict
from optpipe.evaluation.verdict import flag_unchanged_stages, stage_coverage
from optpipe.execution.services import RunServices
from optpipe.instruments import Instrument
from optpipe.model_source import source_fingerprint
from optpipe.recipe import OnnxModel, Recipe
from optpipe.results import StageResult
from optpipe.signal_stack import restore_signal_stack

EAGER_STAGE = "pytorch-eager"


def evaluate_stages(
    recipe: Recipe,
    order: list[str],
    stages: dict[str, StageResult],
    services: RunServices,
    cache: StageCache,
    providers: str,
    instruments: Instrument,
    force: bool = False,
) -> list[StageResult]:
    """Measure every finished stage named in `order` on the same inputs; the reference stage's outputs
    (found in `stages`) are the yardstick. Returns the eager baseline (when measured) then the stages
    of `order`, their results filled in."""
    evaluator = Evaluator(recipe.evaluate, recipe.model_inputs(), cache, services.eval_set, providers, progress=instruments.step, force=force)
    reference = recipe.evaluate.reference or next(n for n in order if recipe.stages[n].after is None)
    ref_stage = stages.get(reference)
    if ref_stage is not None and ref_stage.model is not None:
        artifact = ref_stage.model
        evaluator.set_reference(reference, artifact.content_hash(), lambda: evaluator.onnx_outputs(artifact))

    results = []
    if recipe.evaluate.eager_baseline and not isinstance(recipe.model, OnnxModel):
        results.append(_evaluate_eager(recipe, evaluator, services, instruments))
    for name in order:
        result = stages[name]
        if result.status == "ok":
            _evaluate_stage(result, recipe, evaluator, instruments)
        results.append(result)
    flag_unchanged_stages([stages[name] for name in order], stages)
    return results


def _evaluate_stage(result: StageResult, recipe: Recipe, evaluator: Evaluator, instruments: Instrument) -> None:
    artifact = result.model
    result.hash = artifact.content_hash()
    result.size_bytes = artifact.size_bytes()
    result.info = artifact.info
    dims = {dim: spec_.opt for dim, spec_ in recipe.dims.items()}
    result.coverage, result.warnings = stage_coverage(artifact, dims, result.pass_name, artifact.info.get("excluded"))
    restore_signal_stack()  # OpenVINO may have left it dangling: Ctrl-C must not crash
    instruments.before_evaluation(result.name)
    try:
        accuracy, latency, memory, cached = evaluator.evaluate_onnx(artifact, recipe.tolerance_for(result.name))
    except OptpipeError as exc:
        escalate(exc, evaluator.cache.root)  # a Ctrl-C or a full disk behind it stops the run
        return _evaluation_failed(result, str(exc), instruments)
    except Exception as exc:  # ORT refusing a graph, a shape mismatch: the stage is unusable, say why
        escalate(exc, evaluator.cache.root)
        logging.getLogger("optpipe").debug("evaluation of %s failed", result.name, exc_info=True)
        return _evaluation_failed(result, f"evaluation failed: {type(exc).__name__}: {first_line(exc)}", instruments)
    result.accuracy, result.latency, result.memory = fold_guard_verdict(accuracy, artifact.info), latency, memory
    result.warnings += accuracy.warnings if accuracy else []
    result.cached = result.cached and cached
    instruments.after_evaluation(result)


def _evaluate_eager(recipe: Recipe, evaluator: Evaluator, services: RunServices, instruments: Instrument) -> StageResult:
    result = StageResult(name=EAGER_STAGE, pass_name="eager", status="ok")
    instruments.before_evaluation(EAGER_STAGE)
    try:
        digest = StageCache.key(source=source_fingerprint(recipe.model_source()), inputs=[s.model_dump() for s in recipe.inputs])
        accuracy, latency, memory, cached = evaluator.evaluate_eager(services.torch_model, digest, recipe.evaluate.tolerance)
    except OptpipeError as exc:
        escalate(exc, evaluator.cache.root)  # a Ctrl-C or a full disk behind it stops the run
        _evaluation_failed(result, str(exc), instruments)
        return result
    except Exception as exc:  # the baseline is informative; its failure must not stop the run
        escalate(exc, evaluator.cache.root)
        _evaluation_failed(result, f"PyTorch eager baseline failed: {type(exc).__name__}: {first_line(exc)}", instruments)
        return result
    result.accuracy, result.latency, result.memory, result.cached = accuracy, latency, memory, cached
    result.warnings += accuracy.warnings if accuracy else []
    instruments.after_evaluation(result)
    return result


def _evaluation_failed(result: StageResult, reason: str, instruments: Instrument) -> None:
    result.status = "failed"
    result.reason = reason
    instruments.after_evaluation(result)
