"""Fan-out runs' parts below the search: the driver of a plain recipe (one plan with all its
stages), the run folder and report written from an executor's results, and the rule for a
Pareto frontier over figures from several kinds of machine. optpipe.search.runner drives them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from filelock import FileLock

from optpipe.plan.dag import build_dag, only_order
from optpipe.execution.executors import Plan, Progress, RunMemo
from optpipe.execution.stage_tasks import TaskSettings, hardware_class, held_keeping_figures
from optpipe.core.results import RunReport, StageResult
from optpipe.recipe.run_paths import mark_run_folder
from optpipe.recipe.schema import OnnxModel, Recipe
from optpipe.reporting.run_report import build_report, pareto_frontier, write_report
from optpipe.plan.compile_plan import CompilePlan
from optpipe.plan.validate import validate_recipe


class PlainDriver:
    """A recipe without a search: one plan with every stage."""

    def __init__(self, recipe: Recipe, run_dir: Path, settings: TaskSettings, only: str | None = None,
                 data_warnings: list[str] | None = None):
        validate_recipe(recipe)
        self.recipe = recipe
        self.data_warnings = data_warnings or []  # the preflight's word on the data: the report keeps it
        self.run_dir = run_dir
        self.settings = settings
        self.memo = RunMemo()
        self.order = only_order(build_dag(recipe.stages), only)  # --only: that stage and its ancestors
        self._planned = False

    def next_plan(self, slots: int) -> Plan | None:
        if self._planned:
            return None
        self._planned = True
        return Plan(self.recipe.name, CompilePlan.of(self.recipe), self.order, reference_of(self.recipe), wants_eager(self.recipe), self.settings, self.memo)

    def absorb(self, progress: Progress) -> None:
        pass

    def finish(self, group_by_node: bool, providers: str, progress: Progress, executor=None) -> RunReport:
        return finish_run(self.recipe, self.order, self.memo, self.run_dir, self.settings, group_by_node,
                          targets=targets_on(executor, self.recipe, self.settings, progress), data_warnings=self.data_warnings)

    def close(self) -> None:
        pass

    def failed(self, report: RunReport) -> list[StageResult]:
        return report.failed


def reference_of(recipe: Recipe) -> str:
    return recipe.evaluate.reference or recipe.root_stages()[0]


def wants_eager(recipe: Recipe) -> bool:
    return recipe.evaluate.eager_baseline and not isinstance(recipe.model, OnnxModel)


def targets_on(executor, recipe: Recipe, settings: TaskSettings, progress: Progress) -> Callable | None:
    """The executor's way to build the recipe's targets, given the run's report (None: in the driver)."""
    if executor is None:
        return None
    compile_plan = CompilePlan.of(recipe)
    return lambda report: executor.target_runner(compile_plan, settings, report, progress)


def finish_run(recipe: Recipe, order: list[str], memo: RunMemo, run_dir: Path, settings: TaskSettings,
               group_by_node: bool, search: Callable[[RunReport], dict] | None = None,
               targets: Callable | None = None, data_warnings: list[str] | None = None) -> RunReport:
    """The run folder and its report, as `optpipe compile` writes them, from the memo's results (and the preflight's
    `data_warnings`, which the report keeps as compile's does)."""
    from optpipe.execution.run_folder import publish_stage_folders
    from optpipe.safety.os_errors import folder_errors
    from optpipe.execution.services import RunServices
    from optpipe.reporting.inspection import save_sample_inputs
    from optpipe.safety.recipe_loading import write_recipe_snapshot
    from optpipe.targets import run_targets

    plan = CompilePlan.of(recipe)  # the report and the targets take its typed parts; the snapshot is the recipe itself
    results = ([memo.eager] if memo.eager else []) + [memo.results[name] for name in order]
    report = build_report(plan.name, plan.evaluate, results, data_warnings=data_warnings)
    report.hardware = frontier_by_hardware(report, group_by_node)
    report.search = search(report) if search else None
    cache = settings.open_cache()
    providers = settings.providers
    mark_run_folder(run_dir)
    try:
        # Leased (and rebuilt if a gc pruned them after their tasks ended) before they are copied.
        results = [held_keeping_figures(plan, result, settings, cache) for result in results]
        with folder_errors("output folder", run_dir), FileLock(str(run_dir / ".optpipe.lock")):  # a full disk names it
            publish_stage_folders(run_dir, results)
            if any(r.status == "ok" for r in results):
                save_sample_inputs(run_dir, RunServices(plan.model_source(), plan.data, cache).eval_set().arrays)
            try:
                write_recipe_snapshot(recipe, run_dir)  # beside the report: `optpipe export` reads it
                run_targets(plan.target_settings(cache.root), report, run_dir, cache, providers,
                            runner=targets(report) if targets else None)
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
