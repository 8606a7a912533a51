"""The pass manager: run the stage DAG with the cache, evaluate every stage, write the report.

Phases, each with one job:
1. passes: topological order; each stage is a cache hit or a pass run in a private
   workdir and published atomically; a failing stage marks its descendants skipped
   and the other branches go on;
2. evaluation: every finished stage against the reference stage, plus PyTorch eager;
3. report: report.json (the data) and report.md (a view of it) in the run folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import networkx as nx
from filelock import FileLock

from optpipe.artifact import ModelArtifact
from optpipe.cache.store import StageCache, default_cache_dir, library_versions
from optpipe.calibration.dataset import SampleSet, build_sample_set
from optpipe.dag import ancestors_and_self, execution_order
from optpipe.errors import DataError, OptpipeError, PassError, StageOutOfMemory, first_line
from optpipe.evaluation.evaluator import Evaluator
from optpipe.evaluation.guard import fold_guard_verdict
from optpipe.evaluation.verdict import stage_coverage
from optpipe.reporting.inspection import save_sample_inputs
from optpipe.instruments import Instrument
from optpipe.execution.interrupt import KeptTracker, explain_interruption
from optpipe.execution.isolation import memory_message, run_pass_isolated
from optpipe.results import StageResult
from optpipe.model_source import load_torch_model, source_fingerprint
from optpipe.pass_base import Pass, PassContext
from optpipe.recipe import OnnxModel, Recipe
from optpipe.reporting.run_report import RunReport, build_report, write_report
from optpipe.targets import run_targets
from optpipe.execution.run_folder import publish_stage_folders
from optpipe.validate import validate_recipe

KEY_FORMAT = 1
EAGER_STAGE = "pytorch-eager"


@dataclass
class StageOutcome:
    status: str  # ok | failed | skipped
    artifact: ModelArtifact | None = None
    cached: bool = False
    reason: str | None = None
    duration_s: float = 0.0
    key: str | None = None


@dataclass
class RunOptions:
    output: Path | None = None
    force: bool = False
    only: str | None = None
    cache_dir: Path | None = None
    providers: str = "auto"
    instruments: list[Instrument] = field(default_factory=list)


def compile_recipe(recipe: Recipe, options: RunOptions | None = None) -> RunReport:
    """Run a recipe end to end; returns the report (also written to the run folder)."""
    tracker = KeptTracker()
    options = dataclasses.replace(options or RunOptions())
    options.instruments = [*options.instruments, tracker]
    with explain_interruption(tracker):
        return _compile(recipe, options)


def _compile(recipe: Recipe, options: RunOptions) -> RunReport:
    from optpipe.safety.preflight import preflight

    graph, passes = validate_recipe(recipe)
    run_dir = options.output or recipe.resolve(recipe.output)
    cache = StageCache(options.cache_dir or (recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir()))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    services = RunServices(recipe, cache)
    preflight(recipe, services)

    order = execution_order(graph)
    if options.only:
        if options.only not in graph:
            raise OptpipeError(f"--only: unknown stage '{options.only}'; stages are: {', '.join(order)}")
        keep = ancestors_and_self(graph, options.only)
        order = [name for name in order if name in keep]

    manager = PassManager(recipe, cache, services, run_dir, options)
    try:
        outcomes = manager.run(order, graph, passes)
        results = evaluate_stages(recipe, order, outcomes, services, cache, options)
        report = build_report(recipe, results)
        # Two compiles writing one run folder take turns: each leaves a consistent folder and report.
        with FileLock(str(run_dir / ".optpipe.lock")):
            publish_stage_folders(run_dir, results, outcomes)
            if any(r.status == "ok" for r in results):  # then the evaluation set was built fine
                save_sample_inputs(run_dir, services.eval_set().arrays)  # real inputs for `optpipe diff --layers`
            try:
                run_targets(recipe, report, run_dir, cache, options.providers, lambda *args: _notify(options, *args))
            finally:
                write_report(report, run_dir)  # once, with the targets' rows
    finally:
        cache.release_leases()  # `cache gc` may prune what this run used from now on
    return report


class RunServices:
    """Lazy, run-scoped things passes share: the torch model and the data sets, each built once."""

    def __init__(self, recipe: Recipe, cache: StageCache):
        self.recipe = recipe
        self.cache = cache

    @lru_cache(maxsize=1)
    def torch_model(self):
        return load_torch_model(self.recipe)

    @lru_cache(maxsize=1)
    def eval_set(self) -> SampleSet:
        return build_sample_set(self.recipe.data.eval, self.recipe, self.cache)

    @lru_cache(maxsize=1)
    def calibration_set(self) -> SampleSet:
        source = self.recipe.data.calibration
        if source is None:
            raise DataError("data.calibration: this stage needs a calibration set; add `data: {calibration: ...}` to the recipe")
        return build_sample_set(source, self.recipe, self.cache)


class PassManager:
    def __init__(self, recipe: Recipe, cache: StageCache, services: RunServices, run_dir: Path, options: RunOptions):
        self.recipe = recipe
        self.cache = cache
        self.services = services
        self.run_dir = run_dir
        self.options = options

    def run(self, order: list[str], graph: nx.DiGraph, passes: dict[str, Pass]) -> dict[str, StageOutcome]:
        outcomes: dict[str, StageOutcome] = {}
        self._notify("run_start", order)
        for name in order:
            parent = self.recipe.stages[name].after
            if parent is not None and outcomes[parent].status != "ok":
                outcomes[name] = StageOutcome("skipped", reason=f"parent stage '{parent}' {outcomes[parent].status}")
                self._notify("stage_end", name, "skipped", outcomes[name].reason)
                continue
            self._notify("stage_start", name, passes[name].name)
            outcome = self.run_stage(name, passes[name], outcomes[parent].artifact if parent else None)
            outcomes[name] = outcome
            label = "cached" if outcome.cached else outcome.status
            self._notify("stage_end", name, label, outcome.reason or "")
        return outcomes

    def run_stage(self, name: str, pass_: Pass, model: ModelArtifact | None) -> StageOutcome:
        log_path = self.run_dir / "logs" / f"{name}.log"
        started = time.perf_counter()
        with stage_logger(name, log_path) as log:
            workdir = self.cache.new_workdir()
            ctx = self._context(name, workdir, log)
            try:
                key = self.stage_key(pass_, model, ctx)
                with self.cache.lock(key):
                    hit = None if self.options.force else self.cache.lookup(key)
                    if hit is not None:
                        log.info("cache hit %s", key)
                        return StageOutcome("ok", hit, cached=True, key=key, duration_s=time.perf_counter() - started)
                    log.info("running pass %s v%s with %s", pass_.name, pass_.version, pass_.params.model_dump())
                    self._run_pass(name, pass_, model, ctx, log_path)
                    if self.options.force:
                        self.cache.discard(self.cache.entry_dir(key))
                    artifact = self.cache.publish(key, workdir, {"stage": name, "pass": pass_.name, "recipe": self.recipe.name})
                    return StageOutcome("ok", artifact, key=key, duration_s=time.perf_counter() - started)
            except (PassError, OptpipeError) as exc:
                log.error("%s", exc)
                return self._failed(str(exc), log_path, started)
            except MemoryError as exc:
                log.error("out of memory:\n%s", traceback.format_exc())
                return self._failed(str(StageOutOfMemory(memory_message(exc))), log_path, started)
            except Exception as exc:  # a bug in a pass must not take the other branches down
                log.error("unexpected error:\n%s", traceback.format_exc())
                return self._failed(f"internal error in pass '{pass_.name}' ({type(exc).__name__}: {first_line(exc)})", log_path, started)
            finally:
                self.cache.release_workdir(workdir)

    def _run_pass(self, name: str, pass_: Pass, model: ModelArtifact | None, ctx: PassContext, log_path: Path) -> None:
        """In this process, or in a worker process when the stage has a time limit."""
        timeout_s = self.recipe.stages[name].timeout_s
        if timeout_s is None:
            with contextlib.redirect_stdout(_LogWriter(ctx.log)):
                pass_.run(model, ctx)
            return
        run_pass_isolated(self.recipe, name, pass_, model, ctx.workdir, self.cache.root, log_path, timeout_s)

    def stage_key(self, pass_: Pass, model: ModelArtifact | None, ctx: PassContext) -> str:
        return StageCache.key(
            format=KEY_FORMAT,
            input=model.content_hash() if model else None,
            pass_name=pass_.name,
            version=pass_.version,
            params=pass_.params.model_dump(mode="json"),
            extra=pass_.fingerprint(ctx),
            libraries=library_versions(pass_.libraries),
        )

    def _context(self, name: str, workdir: Path, log: logging.Logger) -> PassContext:
        return PassContext(
            recipe=self.recipe,
            stage=name,
            workdir=workdir,
            log=log,
            cache_dir=self.cache.root,
            torch_model=self.services.torch_model,
            eval_set=self.services.eval_set,
            calibration_set=self.services.calibration_set,
            tolerance=self.recipe.tolerance_for(name),
            progress=lambda task, done, total: self._notify("step", task, done, total),
        )

    def _failed(self, reason: str, log_path: Path, started: float) -> StageOutcome:
        return StageOutcome("failed", reason=f"{reason} (log: {log_path})", duration_s=time.perf_counter() - started)

    def _notify(self, hook: str, *args) -> None:
        for instrument in self.options.instruments:
            getattr(instrument, hook)(*args)


def evaluate_stages(
    recipe: Recipe,
    order: list[str],
    outcomes: dict[str, StageOutcome],
    services: RunServices,
    cache: StageCache,
    options: RunOptions,
) -> list[StageResult]:
    """Measure every finished stage on the same inputs; the reference stage's outputs are the yardstick."""
    evaluator = Evaluator(recipe, cache, services.eval_set, options.providers, progress=lambda *a: _notify(options, "step", *a),
                          force=options.force)
    reference = recipe.evaluate.reference or next(n for n in order if recipe.stages[n].after is None)
    ref_outcome = outcomes.get(reference)
    if ref_outcome is not None and ref_outcome.status == "ok":
        artifact = ref_outcome.artifact
        evaluator.set_reference(reference, artifact.content_hash(), lambda: evaluator.onnx_outputs(artifact))

    results = []
    if recipe.evaluate.eager_baseline and not isinstance(recipe.model, OnnxModel):
        results.append(_evaluate_eager(recipe, evaluator, services, options))
    for name in order:
        results.append(_evaluate_stage(name, recipe, outcomes[name], evaluator, options))
    return results


def _evaluate_stage(name: str, recipe: Recipe, outcome: StageOutcome, evaluator: Evaluator, options: RunOptions) -> StageResult:
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
    _notify(options, "stage_start", f"evaluate {name}", "accuracy and latency")
    try:
        accuracy, latency, memory, cached = evaluator.evaluate_onnx(artifact, recipe.tolerance_for(name))
    except OptpipeError as exc:
        return _evaluation_failed(result, str(exc), options)
    except Exception as exc:  # ORT refusing a graph, a shape mismatch: the stage is unusable, say why
        logging.getLogger("optpipe").debug("evaluation of %s failed", name, exc_info=True)
        return _evaluation_failed(result, f"evaluation failed: {type(exc).__name__}: {first_line(exc)}", options)
    result.accuracy, result.latency, result.memory = fold_guard_verdict(accuracy, artifact.info), latency, memory
    result.warnings += accuracy.warnings if accuracy else []
    result.cached = result.cached and cached
    detail = _summary(result)
    _notify(options, "stage_end", f"evaluate {name}", "cached" if cached else "ok", detail)
    return result


def _evaluate_eager(recipe: Recipe, evaluator: Evaluator, services: RunServices, options: RunOptions) -> StageResult:
    result = StageResult(name=EAGER_STAGE, pass_name="eager", status="ok")
    _notify(options, "stage_start", f"evaluate {EAGER_STAGE}", "accuracy and latency")
    try:
        digest = StageCache.key(source=source_fingerprint(recipe), inputs=[s.model_dump() for s in recipe.inputs])
        accuracy, latency, memory, cached = evaluator.evaluate_eager(services.torch_model, digest, recipe.evaluate.tolerance)
    except OptpipeError as exc:
        return _evaluation_failed(result, str(exc), options)
    except Exception as exc:  # the baseline is informative; its failure must not stop the run
        return _evaluation_failed(result, f"PyTorch eager baseline failed: {type(exc).__name__}: {first_line(exc)}", options)
    result.accuracy, result.latency, result.memory, result.cached = accuracy, latency, memory, cached
    result.warnings += accuracy.warnings if accuracy else []
    _notify(options, "stage_end", f"evaluate {EAGER_STAGE}", "cached" if cached else "ok", _summary(result))
    return result


def _evaluation_failed(result: StageResult, reason: str, options: RunOptions) -> StageResult:
    result.status = "failed"
    result.reason = reason
    _notify(options, "stage_end", f"evaluate {result.name}", "failed", reason)
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


@contextlib.contextmanager
def stage_logger(name: str, path: Path, truncate: bool = True):
    """A logger writing to the stage's log file (and Python warnings with it) while the stage runs.

    Appending (after truncating once): a stage's worker process writes to the same file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if truncate:
        path.write_text("", encoding="utf-8")
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger(f"optpipe.stage.{name}")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(handler)
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield log
    finally:
        logging.captureWarnings(False)
        warnings_log.removeHandler(handler)
        log.removeHandler(handler)
        handler.close()


class _LogWriter:
    """A file-like object sending what libraries print into the stage log instead of the terminal."""

    def __init__(self, log: logging.Logger):
        self.log = log

    def write(self, text: str) -> int:
        if text.strip():
            self.log.info("%s", text.rstrip())
        return len(text)

    def flush(self) -> None:
        pass


def _notify(options: RunOptions, hook: str, *args) -> None:
    for instrument in options.instruments:
        getattr(instrument, hook)(*args)
