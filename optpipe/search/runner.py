"""Several recipes (and searches) on one executor: rounds of plans, then one report per recipe.

Each round asks every recipe's driver for its next plan (a plain recipe: all its stages at
once; a search: its next trials), runs them together on the executor, and feeds the results
back. A driver killed half-way loses nothing: every stage and evaluation is in the cache,
and a rerun finds them there.
"""
from __future__ import annotations

import time
from pathlib import Path

from optpipe.cache.remote_io import check_apart
from optpipe.cache.store import LeaseSet
from optpipe.core.errors import OptpipeError
from optpipe.execution.executors import Executor, Progress, settings_for
from optpipe.execution.fan_out import PlainDriver
from optpipe.execution.stage_tasks import TaskSettings
from optpipe.recipe.schema import Recipe
from optpipe.core.results import RunReport, StageResult
from optpipe.recipe.run_paths import RunPaths
from optpipe.search.driver import SearchDriver
from optpipe.search.space import SearchSpace


def compile_recipes(recipes: list[Recipe], executor: Executor, *, cache_dir: Path | None = None, output: Path | None = None,
                    force: bool = False, providers: str = "auto", yes: bool = False, group_by_node: bool = False,
                    progress: Progress | None = None, remote_cache: str | None = None,
                    storage_options: dict | None = None, only: str | None = None) -> list[tuple[RunReport, list[StageResult]]]:
    """Run every recipe (searches included) on `executor`; one report per recipe and the stages that failed.
    `only`: one plain recipe's stage and its ancestors (`--only`)."""
    if output is not None and len(recipes) > 1:
        raise OptpipeError("--output names one run folder; with several recipes each writes to its own `output`")
    progress = progress or Progress(show_recipe=len(recipes) > 1)
    drivers = []
    folders = [RunPaths.for_run(recipe, output, cache_dir) for recipe in recipes]  # all refused before any work
    _distinct_run_folders(recipes, [paths.run_dir for paths in folders])
    for recipe, paths in zip(recipes, folders):
        run_dir, cache = paths.run_dir, paths.cache_dir
        if remote_cache:
            check_apart(remote_cache, cache)
        settings = settings_for(cache, run_dir, force, providers, remote_cache, storage_options)
        said = _preflight(recipe, settings, executor.runs_here)
        if SearchSpace.declared(recipe):
            drivers.append(SearchDriver(recipe, run_dir, settings, yes, said))
        else:
            drivers.append(PlainDriver(recipe, run_dir, settings, only, said))
    started = time.perf_counter()
    try:
        reports = _run(drivers, executor, progress, group_by_node, providers)
    finally:
        for driver in drivers:
            driver.close()
    stages = sum(len(r.stages) for r, _ in reports)
    progress.line(f"done: {len(reports)} recipe{'s' if len(reports) != 1 else ''}, {stages} stages, "
                  f"wall {time.perf_counter() - started:.1f}s")
    return reports


def _distinct_run_folders(recipes: list[Recipe], run_dirs: list[Path]) -> None:
    """Two recipes writing one run folder would leave only the last one's report, silently."""
    seen: dict[Path, int] = {}
    for i, run_dir in enumerate(run_dirs):
        key = run_dir.resolve()
        if key in seen:
            first = seen[key]
            raise OptpipeError(f"recipes {first + 1} ('{recipes[first].name}') and {i + 1} ('{recipes[i].name}') both write to "
                               f"{run_dir}; give each its own `output`")
        seen[key] = i


def _run(drivers: list, executor: Executor, progress: Progress, group_by_node: bool, providers: str) -> list:
    held: dict[Path, LeaseSet] = {}  # per cache folder: every stage computed so far, until the reports are written
    try:
        active = list(drivers)
        while active:
            plans = {id(d): d.next_plan(executor.slots) for d in active}
            active = [d for d in active if plans[id(d)] is not None]
            if not active:
                break
            executor.run([plans[id(d)] for d in active], progress)
            for driver in active:
                _hold_outcomes(plans[id(driver)], held)
                driver.absorb(progress)
        reports = []
        for driver in drivers:
            report = driver.finish(group_by_node, providers, progress, executor)
            reports.append((report, driver.failed(report)))
        return reports
    finally:
        for leases in held.values():
            leases.close()


def _hold_outcomes(plan, held: dict) -> None:
    """Lease the round's stage entries for the rest of the run: later trials and the report read
    them, and each task dropped its own leases when it ended (the tasks also rebuild an entry a
    gc pruned in between; these leases make that the exception)."""
    root = plan.settings.cache_dir
    leases = held.setdefault(root, LeaseSet(root))
    for outcome in plan.memo.outcomes.values():
        model = outcome.model
        if outcome.status == "ok" and model is not None and model.folder.parent.parent == root:
            leases.hold(model.folder.name)


def _preflight(recipe: Recipe, settings: TaskSettings, here: bool) -> list[str]:
    """The pipeline's checks before any stage runs (model file, data sets): a user error costs one line. Returns what
    it warned of the data, for the report.

    Memory: where the stages run on this machine (`here`), the run is refused at once only where nothing could run,
    as `compile` does; each stage that will not fit fails before it runs, in its task (stage_tasks: a search
    trial's own params). On a Ray cluster this machine's memory says nothing of the nodes': the tasks alone judge."""
    from optpipe.execution.services import RunServices
    from optpipe.source.model_source import onnx_path
    from optpipe.plan.source_preflight import check_generation, source_preflight
    from optpipe.safety.preflight import preflight

    cache = settings.open_cache()  # also creates the folder layout once, before any task uses it
    try:
        services, onnx = RunServices(recipe.model_source(), recipe.data, cache), onnx_path(recipe.model_source())
        said = preflight(recipe, onnx, services.eval_set, services.calibration_set, cache)
        if here:
            source_preflight(recipe, onnx)
        else:
            check_generation(recipe, onnx)
        return said
    finally:
        cache.release_leases()
