"""Stage evaluation: every finished stage measured on the same inputs against the reference
stage's outputs, plus the PyTorch eager baseline. A failed measurement marks its stage
failed with the reason; it never stops the run.

Two phases: accuracy and the headline latencies (batch_sizes) of every stage, then the sweep
curves (`evaluate.sweep`) of the stages that get them: with `sweep_stages: frontier` (the
default) the Pareto frontier's and the eager baseline's, since a curve is read for the stages
one might pick; `all` sweeps every stage. The frontier is the report's own (same function)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from optpipe.cache.store import StageCache
from optpipe.execution.interrupt import escalate
from optpipe.core.errors import OptpipeError, first_line
from optpipe.evaluation.evaluator import Evaluator
from optpipe.evaluation.guard_verdict import fold_guard_verdict
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.evaluation.verdict import flag_unchanged_stages, flag_unfaithful_reference, stage_coverage
from optpipe.execution.services import RunServices
from optpipe.pass_infra.instruments import Instrument
from optpipe.source.model_source import source_fingerprint
from optpipe.source.torch_weights import fp32_weight_bytes
from optpipe.plan.compile_plan import CompilePlan
from optpipe.plan.source_preflight import eager_timing
from optpipe.recipe.schema import EvaluateSpec, ModelSource, OnnxModel, Tolerance
from optpipe.core.process_memory import release_freed_memory
from optpipe.core.results import EAGER, StageResult, error_kind
from optpipe.core.signal_stack import restore_signal_stack


@dataclass(frozen=True)
class EvaluationParts:
    """What stage evaluation reads from the recipe, resolved once at the top (`of`)."""

    evaluate: EvaluateSpec
    source: ModelSource  # the model (its eager baseline's digest) with its inputs and dims
    parents: Mapping[str, Optional[str]]  # each stage's `after`: the default reference is a root
    tolerances: Mapping[str, Tolerance]  # each stage's own tolerance, else evaluate's
    # Each export stage's self-check: where one is the reference, eager's row holds it to that rule on the data too.
    export_checks: Mapping[str, SelfCheckParams] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: CompilePlan) -> "EvaluationParts":
        params = {name: plan.configured_pass(name).params for name, stage in plan.stages.items() if stage.pass_name == "export"}
        checks = {name: p for name, p in params.items() if isinstance(p, SelfCheckParams) and p.check_enforced}
        return cls(plan.evaluate, plan.model_source(), plan.parents(), plan.tolerances(), checks)

    def tolerance_for(self, stage: str) -> Tolerance:
        return self.tolerances.get(stage, self.evaluate.tolerance)


def evaluate_stages(
    parts: EvaluationParts,
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
    timing = eager_timing(parts.evaluate.eager_timing, fp32_weight_bytes(parts.source))
    evaluator = Evaluator(parts.evaluate, parts.source, cache, services.eval_set, providers, progress=instruments.step, force=force,
                          eager_timing=timing)
    reference = parts.evaluate.reference or next(n for n in order if parts.parents.get(n) is None)
    ref_stage = stages.get(reference)
    if ref_stage is not None and ref_stage.model is not None:
        artifact = ref_stage.model
        evaluator.set_reference(reference, artifact.content_hash(), lambda: evaluator.onnx_outputs(artifact))

    source_check = SourceCheck(parts.source, evaluator, services.torch_model)
    generation = None
    if parts.evaluate.generation is not None:  # a decoder: measured by generation, not by one forward
        from optpipe.evaluation.generation_eval import GenerationEvaluator

        generation = GenerationEvaluator(parts.evaluate, parts.source, cache, instruments.step, force, eager_timing=timing)
        if ref_stage is not None and ref_stage.model is not None:  # the yardstick where eager is not measured
            generation.set_reference_stage(reference, ref_stage.model)
    if reference in parts.export_checks and generation is None:
        evaluator.set_export_check(parts.export_checks[reference])
    results = []
    if parts.evaluate.eager_baseline and not isinstance(parts.source.model, OnnxModel):
        results.append(_evaluate_eager(parts, generation or evaluator, services, instruments, source_check))
    eager = results[0] if results else None

    def flag(result: StageResult) -> None:  # eager's row found the export wrong on the data: each line says so as shown
        if eager is not None:
            flag_unfaithful_reference([eager, result], reference)

    for name in order:
        result = stages[name]
        if result.status == "ok":
            _evaluate_stage(result, parts, evaluator, instruments, source_check, generation, flag)
        results.append(result)
    flag_unchanged_stages([stages[name] for name in order], stages, cache)
    if parts.evaluate.sweep and generation is None:
        _sweep(results, parts, evaluator, instruments)
    return results


def _sweep(results: list[StageResult], parts: EvaluationParts, evaluator: Evaluator, instruments: Instrument) -> None:
    """Phase 2: the sweep points of the stages that get curves, appended to their latency rows."""
    from optpipe.reporting.run_report import pareto_frontier

    chosen = set(pareto_frontier(results)) if parts.evaluate.sweep_stages == "frontier" else {r.name for r in results}
    for result in results:
        if result.status != "ok" or not result.latency or (result.name not in chosen and result.name != EAGER):
            continue
        if result.name == EAGER and not chosen - {EAGER}:
            continue  # no stage has curves: the baseline's alone would compare with nothing
        instruments.before_sweep(result.name)  # a sweep point at batch 16 can take seconds: shown as progress
        try:
            if result.name == EAGER:
                points, cached = evaluator.sweep_eager(_eager_digest(parts), result.latency)
            else:
                points, cached = evaluator.sweep_onnx(result.model, result.latency)
        except Exception as exc:  # a shape the model refuses: the curve is missing, the stage's verdict stands
            escalate(exc, evaluator.cache.root)
            logging.getLogger("optpipe").debug("sweep of %s failed", result.name, exc_info=True)
            result.warnings.append(f"latency sweep failed: {type(exc).__name__}: {first_line(exc)}")
            instruments.sweep_done(result.name, 0, False, result.warnings[-1])
            continue
        instruments.sweep_done(result.name, len(points), cached)
        release_freed_memory()  # the curve's runtime is gone: the next stage's is built without its pages
        result.latency = [*result.latency, *points]
        result.evaluation_cached = bool(result.evaluation_cached) and cached


def _evaluate_stage(result: StageResult, parts: EvaluationParts, evaluator: Evaluator, instruments: Instrument,
                    source_check: "SourceCheck | None" = None, generation=None,
                    flag: Callable[[StageResult], object] = lambda result: None) -> None:
    artifact = result.model
    result.hash = artifact.content_hash()
    result.size_bytes = artifact.size_bytes()
    result.info = artifact.info
    dims = {dim: spec_.opt for dim, spec_ in parts.source.dims.items()}
    result.coverage, result.warnings = stage_coverage(artifact, dims, result.pass_name, artifact.info.get("excluded"), evaluator.cache)
    restore_signal_stack()  # OpenVINO may have left it dangling: Ctrl-C must not crash
    release_freed_memory()  # the last stage's session and outputs, freed, leave this one's peak (core/process_memory.py)
    instruments.before_evaluation(result.name)
    try:
        if generation is not None:
            accuracy, latency, memory, cached = generation.evaluate_stage(result.name, artifact, parts.tolerance_for(result.name))
            result.generation = generation.generation_of(artifact.content_hash())
        else:
            accuracy, latency, memory, cached = evaluator.evaluate_onnx(artifact, parts.tolerance_for(result.name))
    except OptpipeError as exc:
        escalate(exc, evaluator.cache.root)  # a Ctrl-C or a full disk behind it stops the run
        result.error_kind = error_kind(exc)  # a task or labels the model cannot carry: the user's (exit 2)
        return _evaluation_failed(result, str(exc), instruments)
    except Exception as exc:  # ORT refusing a graph, a shape mismatch: the stage is unusable, say why
        escalate(exc, evaluator.cache.root)
        logging.getLogger("optpipe").debug("evaluation of %s failed", result.name, exc_info=True)
        refusal = source_check.refusal() if source_check is not None else None
        if refusal is not None:  # the user's own model refuses the data too: the data's fault, not the stage's
            result.error_kind = "input"
            return _evaluation_failed(result, refusal, instruments)
        return _evaluation_failed(result, f"evaluation failed: {type(exc).__name__}: {first_line(exc)}", instruments)
    # Its session is gone: what it freed goes back now, not at the next stage's evaluation (BERT-base: an
    # ORT row left 0.6-0.7 GB of freed pages resident; after the last row, the sweeps and targets ran on top).
    release_freed_memory()
    result.accuracy, result.latency, result.memory = fold_guard_verdict(accuracy, artifact.info), latency, memory
    result.warnings += accuracy.warnings if accuracy else []
    result.evaluation_cached = cached  # apart from result.cached, the pass's: the report tells the two apart
    flag(result)
    instruments.after_evaluation(result)


def _evaluate_eager(parts: EvaluationParts, evaluator: Evaluator, services: RunServices, instruments: Instrument,
                    source_check: "SourceCheck") -> StageResult:
    result = StageResult(name=EAGER, pass_name="eager", status="ok")
    instruments.before_evaluation(EAGER)
    try:
        digest = _eager_digest(parts)
        accuracy, latency, memory, cached = evaluator.evaluate_eager(services.torch_model, digest, parts.evaluate.tolerance,
                                                                     release=lambda: services.release_torch_model(always=True))
    except OptpipeError as exc:
        escalate(exc, evaluator.cache.root)  # a Ctrl-C or a full disk behind it stops the run
        result.error_kind = error_kind(exc)  # a broken model source is the user's, here as in export
        _evaluation_failed(result, str(exc), instruments)
        return result
    except Exception as exc:  # the baseline is informative; its failure must not stop the run
        escalate(exc, evaluator.cache.root)
        refusal = source_check.refusal()
        if refusal is not None:  # forward() refuses the evaluation data: the stages meet the same, one line for all
            result.error_kind = "input"
            _evaluation_failed(result, refusal, instruments)
            return result
        _evaluation_failed(result, f"PyTorch eager baseline failed: {type(exc).__name__}: {first_line(exc)}", instruments)
        return result
    result.accuracy, result.latency, result.memory, result.cached = accuracy, latency, memory, cached
    result.generation = getattr(evaluator, "generation_of", lambda _: None)("eager")
    result.evaluation_cached = cached  # the baseline has no pass: its figures are all there is to reuse
    result.warnings += accuracy.warnings if accuracy else []
    instruments.after_evaluation(result)
    return result


class SourceCheck:
    """After a stage's model fails on the evaluation data, whether the recipe's own model (its
    ONNX file, or PyTorch eager) fails on the same batches too. If it does, the data (or the
    recipe's input ranges and dims) do not fit the model, whatever the stage did: the user's
    input to fix (exit 2), with the runtime's reason. If it runs, the stage broke something:
    exit 1 as before. Asked only after a failure (a run that succeeds pays nothing), once per run."""

    def __init__(self, source: ModelSource, evaluator: Evaluator, torch_model):
        self.source, self.evaluator, self.torch_model = source, evaluator, torch_model
        self._refusal: Optional[str] = None
        self._asked = False

    def refusal(self) -> Optional[str]:
        if not self._asked:
            self._asked = True
            self._refusal = self._run()
        return self._refusal

    def _run(self) -> Optional[str]:
        from optpipe.evaluation.accuracy import run_callable, run_onnx
        from optpipe.source.model_source import onnx_path
        from optpipe.core.runtime import eager_runner

        evaluator = self.evaluator
        try:
            if isinstance(self.source.model, OnnxModel):
                run_onnx(onnx_path(self.source), evaluator.accuracy_batches, evaluator.settings.threads, evaluator.providers)
            else:
                run_callable(eager_runner(self.torch_model(), evaluator.settings.threads), evaluator.accuracy_batches)
        except Exception as exc:
            escalate(exc, evaluator.cache.root)
            return (f"data.eval: the recipe's own model fails on the evaluation data ({first_line(exc)[:300]}); "
                    "fix the data, or the inputs' `range` and `dims`, to what the model accepts")
        return None


def _eager_digest(parts: EvaluationParts) -> str:
    return StageCache.key(source=source_fingerprint(parts.source), inputs=[s.model_dump() for s in parts.source.inputs])


def _evaluation_failed(result: StageResult, reason: str, instruments: Instrument) -> None:
    result.status = "failed"
    result.reason = reason
    instruments.after_evaluation(result)
