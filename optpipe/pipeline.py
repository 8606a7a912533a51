"""The pass manager: run the stage DAG with the cache, evaluate every stage, write the report.

Phases, each with one job and its own module:
1. passes (here, the loop): topological order; each stage goes to the cached stage
   runner (optpipe/execution/stage_runner.py); a failing stage marks its descendants
   skipped and the other branches go on;
2. evaluation (optpipe/execution/stage_evaluation.py): every finished stage against
   the reference stage, plus PyTorch eager;
3. report: report.json (the data) and report.md (a view of it) in the run folder,
   then the deployment targets.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
from filelock import FileLock

from optpipe.artifact import ModelArtifact
from optpipe.cache.store import StageCache, default_cache_dir
from optpipe.dag import ancestors_and_self, execution_order
from optpipe.cache.folder import check_apart
from optpipe.errors import OptpipeError
from optpipe.execution.interrupt import KeptTracker, explain_interruption
from optpipe.execution.run_folder import publish_stage_folders
from optpipe.execution.services import RunServices
from optpipe.execution.stage_evaluation import EAGER_STAGE, evaluate_stages  # noqa: F401  (EAGER_STAGE: public name)
from optpipe.execution.stage_runner import StageOutcome, StageRunner
from optpipe.instruments import Instrument
from optpipe.pass_base import Pass
from optpipe.recipe import Recipe
from optpipe.reporting.inspection import save_sample_inputs
from optpipe.reporting.run_report import RunReport, build_report, write_report
from optpipe.safety.os_errors import folder_errors
from optpipe.targets import run_targets
from optpipe.validate import validate_recipe


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
    cache_root = options.cache_dir or (recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir())
    check_apart(run_dir, cache_root)  # `cache gc` must never remove a run, nor a run folder the cache
    with folder_errors("cache folder", cache_root):
        cache = StageCache(cache_root)
    with folder_errors("output folder", run_dir):
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    services = RunServices(recipe, cache)
    preflight(recipe, services.eval_set, services.calibration_set)
    order = _stages_to_run(graph, options.only)

    manager = PassManager(recipe, cache, services, run_dir, options)
    notify = manager._notify
    try:
        outcomes = manager.run(order, graph, passes)
        results = evaluate_stages(recipe, order, outcomes, services, cache, options.providers, notify, options.force)
        report = build_report(recipe, results)
        # Two compiles writing one run folder take turns: each leaves a consistent folder and report.
        with FileLock(str(run_dir / ".optpipe.lock")):
            publish_stage_folders(run_dir, results, outcomes)
            if any(r.status == "ok" for r in results):  # then the evaluation set was built fine
                save_sample_inputs(run_dir, services.eval_set().arrays)  # real inputs for `optpipe diff --layers`
            try:
                run_targets(recipe, report, run_dir, cache, options.providers, notify)
            finally:
                write_report(report, run_dir)  # once, with the targets' rows
    finally:
        cache.release_leases()  # `cache gc` may prune what this run used from now on
    return report


def _stages_to_run(graph: nx.DiGraph, only: str | None) -> list[str]:
    order = execution_order(graph)
    if only is None:
        return order
    if only not in graph:
        raise OptpipeError(f"--only: unknown stage '{only}'; stages are: {', '.join(order)}")
    keep = ancestors_and_self(graph, only)
    return [name for name in order if name in keep]


class PassManager:
    """The loop over stages in order: a stage whose parent did not finish is skipped, the
    others go to the cached stage runner."""

    def __init__(self, recipe: Recipe, cache: StageCache, services: RunServices, run_dir: Path, options: RunOptions):
        self.recipe = recipe
        self.options = options
        self.runner = StageRunner(
            recipe, cache, services, run_dir / "logs", force=options.force,
            progress=lambda task, done, total: self._notify("step", task, done, total),
        )

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
            outcome = self.runner.run(name, passes[name], _artifact(outcomes, parent))
            outcomes[name] = outcome
            self._notify("stage_end", name, "cached" if outcome.cached else outcome.status, outcome.reason or "")
        return outcomes

    def _notify(self, hook: str, *args) -> None:
        for instrument in self.options.instruments:
            getattr(instrument, hook)(*args)


def _artifact(outcomes: dict[str, StageOutcome], parent: str | None) -> ModelArtifact | None:
    return outcomes[parent].artifact if parent else None
