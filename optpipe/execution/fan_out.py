"""Several recipes (and searches) on one executor: rounds of plans, then one report per recipe.

Each round asks every recipe's driver for its next plan (a plain recipe: all its stages at
once; a search: its next trials), runs them together on the executor, and feeds the results
back. A driver killed half-way loses nothing: every stage and evaluation is in the cache,
and a rerun finds them there.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from filelock import FileLock

from optpipe.cache.folder import check_apart
from optpipe.dag import build_dag, execution_order
from optpipe.errors import OptpipeError
from optpipe.execution.executors import Executor, Plan, Progress, RunMemo, settings_for
from optpipe.execution.stage_tasks import TaskSettings, hardware_class
from optpipe.results import RunReport, StageResult
from optpipe.recipe import OnnxModel, Recipe
from optpipe.reporting.run_report import build_report, pareto_frontier, write_report
from optpipe.run_paths import RunPaths
from optpipe.validate import validate_recipe


class PlainDriver:
    """A recipe without a search: one plan with every stage."""

    def __init__(self, recipe: Recipe, run_dir: Path, settings: TaskSettings):
        validate_recipe(recipe)
        self.recipe = recipe
        self.run_dir = run_dir
        self.settings = settings
        self.memo = RunMemo()
        self.order = execution_order(build_dag(recipe.stages))
        self._planned = False

    def next_plan(self, slots: int) -> Plan | None:
        if self._planned:
            return None
        self._planned = True
        return Plan(self.recipe.name, self.recipe, self.order, reference_of(self.recipe), wants_eager(self.recipe), self.settings, self.memo)

    def absorb(self, progress: Progress) -> None:
        pass

    def finish(self, group_by_node: bool, providers: str, progress: Progress) -> RunReport:
        return finish_run(self.recipe, self.order, self.memo, self.run_dir, self.settings, group_by_node)

    def failed(self, report: RunReport) -> list[StageResult]:
        return report.failed


def _preflight(recipe: Recipe, settings: TaskSettings) -> None:
    """The pipeline's checks before any stage runs (model file, data sets): a user error costs one line."""
    from optpipe.execution.services import RunServices
    from optpipe.model_source import onnx_path
    from optpipe.safety.preflight import preflight

    cache = settings.open_cache()  # also creates the folder layout once, before any task uses it
    try:
        services = RunServices(recipe, cache)
        preflight(recipe, onnx_path(recipe), services.eval_set, services.calibration_set)
    finally:
        cache.release_leases()


def reference_of(recipe: Recipe) -> str:
    return recipe.evaluate.reference or recipe.root_stages()[0]


def wants_eager(recipe: Recipe) -> bool:
    return recipe.evaluate.eager_baseline and not isinstance(recipe.model, OnnxModel)


def compile_recipes(recipes: list[Recipe], executor: Executor, *, cache_dir: Path | None = None, output: Path | None = None,
                    force: bool = False, providers: str = "auto", yes: bool = False, group_by_node: bool = False,
                    progress: Progress | None = None, remote_cache: str | None = None,
                    storage_options: dict | None = None) -> list[tuple[RunReport, list[StageResult]]]:
    """Run every recipe (searches included) on `executor`; one report per recipe and the stages that failed."""
    from optpipe.search.driver import SearchDriver
    from optpipe.search.space import SearchSpace

    if output is not None and len(recipes) > 1:
        raise OptpipeError("--output names one run folder; with several recipes each writes to its own `output`")
    progress = progress or Progress(show_recipe=len(recipes) > 1)
    drivers = []
    for recipe in recipes:
        paths = RunPaths.resolve(recipe, output, cache_dir)
        run_dir, cache = paths.run_dir, paths.cache_dir
        check_apart(run_dir, cache)  # as a local compile: `cache gc` must never remove a run, nor a run the cache
        settings = settings_for(recipe, cache, run_dir, force, providers, remote_cache, storage_options)
        _preflight(recipe, settings)
        if SearchSpace.declared(recipe):
            drivers.append(SearchDriver(recipe, run_dir, settings, yes))
        else:
            drivers.append(PlainDriver(recipe, run_dir, settings))
    started = time.perf_counter()
    active = list(drivers)
    while active:
        plans = {id(d): d.next_plan(executor.slots) for d in active}
        active = [d for d in active if plans[id(d)] is not None]
        if not active:
            break
        executor.run([plans[id(d)] for d in active], progress)
        for driver in active:
            driver.absorb(progress)
    reports = []
    for driver in drivers:
        report = driver.finish(group_by_node, providers, progress)
        reports.append((report, driver.failed(report)))
    stages = sum(len(r.stages) for r, _ in reports)
    progress.line(f"done: {len(reports)} recipe{'s' if len(reports) != 1 else ''}, {stages} stages, "
                  f"wall {time.perf_counter() - started:.1f}s")
    return reports


def finish_run(recipe: Recipe, order: list[str], memo: RunMemo, run_dir: Path, settings: TaskSettings,
               group_by_node: bool, search: Callable[[RunReport], dict] | None = None) -> RunReport:
    """The run folder and its report, as `optpipe compile` writes them, from the memo's results."""
    from optpipe.execution.run_folder import publish_stage_folders
    from optpipe.execution.services import RunServices
    from optpipe.reporting.inspection import save_sample_inputs
    from optpipe.targets import run_targets

    results = ([memo.eager] if memo.eager else []) + [memo.results[name] for name in order]
    report = build_report(recipe, results)
    report.hardware = frontier_by_hardware(report, group_by_node)
    report.search = search(report) if search else None
    cache = settings.open_cache()
    providers = settings.providers
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(run_dir / ".optpipe.lock")):
            publish_stage_folders(run_dir, results)
            if any(r.status == "ok" for r in results):
                save_sample_inputs(run_dir, RunServices(recipe, cache).eval_set().arrays)
            try:
                run_targets(recipe, report, run_dir, cache, providers)
            finally:
                write_report(report, run_dir)  # once, with the targets' rows
    finally:
        cache.release_leases()
    return report


def frontier_by_hardware(report: RunReport, group_by_node: bool) -> dict | None:
    """One Pareto frontier only over figures from one kind of machine.

    Latency from two kinds of machine is not comparable: with several, the frontier is
    refused (empty, with the reason) unless the user groups by node type, which draws one
    frontier per kind.
    """
    classes: dict[str, list[StageResult]] = {}
    for stage in report.stages:
        if stage.measured_on and stage.latency:
            classes.setdefault(hardware_class(stage.measured_on), []).append(stage)
    if len(classes) <= 1:
        return {"classes": list(classes)} if classes else None
    if not group_by_node:
        report.pareto = []
        for stage in report.stages:
            stage.pareto = False
        return {"classes": list(classes), "frontier": "refused",
                "reason": f"latency was measured on {len(classes)} kinds of machine ({'; '.join(classes)}); "
                          "one frontier across them would compare unlike figures: rerun with --group-by-node"}
    frontiers = {cls: pareto_frontier(stages) for cls, stages in classes.items()}
    report.pareto = [name for names in frontiers.values() for name in names]
    for stage in report.stages:
        stage.pareto = stage.name in report.pareto
    return {"classes": list(classes), "frontier": "per node type", "frontiers": frontiers}
