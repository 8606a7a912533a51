"""A search run: rounds of trials from the strategy, each trial ordinary cached stages,
until the budget (trials, wall time) or the space is spent. Failed trials are results too:
they are reported with their reason and the search goes on."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optpipe.plan.dag import build_dag, execution_order
from optpipe.core.errors import RecipeError
from optpipe.execution.executors import Plan, Progress, RunMemo, result_detail
from optpipe.execution.stage_tasks import TaskSettings
from optpipe.execution.fan_out import finish_run, reference_of, targets_on, wants_eager
from optpipe.core.results import StageResult
from optpipe.plan.compile_plan import CompilePlan
from optpipe.recipe.schema import Recipe
from optpipe.core.results import RunReport
from optpipe.search.checks import check_searched_values, check_trial
from optpipe.search.report import search_section
from optpipe.search.space import ENABLED, SearchSpace, Trial
from optpipe.recipe.search_spec import GRID_CONFIRM_LIMIT, SearchSettings
from optpipe.search.strategies import make_proposer, resolve_strategy
from optpipe.search.study import study_path


#: A sampler that proposes only points already tried this many times in a row (or the trial
#: budget's count, if larger) has converged on its space: the search stops there.
REPEAT_LIMIT = 20


@dataclass
class TrialRecord:
    number: int
    trial: Trial
    stage: str | None  # the trial's last stage in the expanded recipe
    repeat_of: int | None = None  # optuna may propose a point again: measured once, listed once
    refused: str | None = None  # its params refused together (checks.check_trial): failed, never run


class SearchDriver:
    def __init__(self, recipe: Recipe, run_dir: Path, settings: TaskSettings, yes: bool, data_warnings: list[str] | None = None):
        self.recipe = recipe
        self.data_warnings = data_warnings or []  # the preflight's word on the data: the report keeps it
        self.run_dir = run_dir
        self.space = SearchSpace(recipe)
        self.settings = recipe.evaluate.search or SearchSettings()
        self.strategy, self.budget = resolve_strategy(self.space, self.settings, yes)
        check_searched_values(self.space)
        study = study_path(recipe, self.space, self.settings, run_dir) if self.strategy == "optuna" else None
        self.proposer = make_proposer(self.space, self.settings, self.strategy, self.budget, study, settings.force)
        self.task_settings = settings
        self.memo = RunMemo()
        self.records: list[TrialRecord] = []
        self.pending: list[tuple[Any, Trial]] = []
        self.expanded, self.leaves = self.space.expand([])
        self.started: float | None = None
        self.stopped = ""
        self.repeats_in_a_row = 0
        self.refused: dict[Trial, str] = {}
        self._resume(self.proposer.resumed())

    def _resume(self, trials: list[Trial]) -> None:
        """A saved study's finished trials are this run's first: measured again from the cache, told to no one."""
        if not trials:
            self.unreported: list[TrialRecord] = []
            return
        for trial in trials:
            self._check(trial)
        self.expanded, self.leaves = self.space.expand([t for t in dict.fromkeys(trials) if t not in self.refused])
        seen: dict[Trial, int] = {}
        for trial in trials:
            record = TrialRecord(len(self.records) + 1, trial, self.leaves.get(trial), seen.get(trial), self.refused.get(trial))
            seen.setdefault(trial, record.number)
            self.records.append(record)
        self.unreported = list(self.records)

    # The driver protocol of optpipe.execution.fan_out.
    def next_plan(self, slots: int) -> Plan | None:
        self.started = self.started or time.perf_counter()
        count = self._room(slots)
        resumed = [r for r in self.unreported if r.stage and r.stage not in self.memo.results]
        if count == 0 and not resumed:
            return None
        self.pending = self.proposer.ask(count) if count else []
        for _, trial in self.pending:
            self._check(trial)
        trials = [t for t in [r.trial for r in self.records] + [t for _, t in self.pending] if t not in self.refused]
        self.expanded, self.leaves = self.space.expand(list(dict.fromkeys(trials)))
        order = execution_order(build_dag(self.expanded.stages))
        new = [name for name in order if name not in self.memo.results]
        eager = wants_eager(self.recipe) and self.memo.eager is None
        return Plan(self.recipe.name, CompilePlan.of(self.expanded), new, reference_of(self.expanded), eager, self.task_settings, self.memo)

    def absorb(self, progress: Progress) -> None:
        seen = {r.trial: r.number for r in self.records if r.repeat_of is None}
        for record in self.unreported:
            result = self.memo.results.get(record.stage) if record.stage else None
            detail = _detail(result, record.refused)
            progress.line(f"  {self._label(record)} from the saved study: {_shown(record.trial)} -> {record.stage} — {detail}")
        self.unreported = []
        for handle, trial in self.pending:
            refused = self.refused.get(trial)
            stage = None if refused else self.leaves.get(trial)
            result = self.memo.results.get(stage) if stage else None
            self.proposer.tell(handle, result, refused)
            record = TrialRecord(len(self.records) + 1, trial, stage, seen.get(trial), refused)
            seen.setdefault(trial, record.number)
            self.records.append(record)
            detail = _detail(result, refused)
            status = result.status if result else "failed"
            if result is not None and result.accuracy is not None and status == "ok" and not result.accuracy.within_tolerance:
                status = "out of tolerance"
            again = f" (repeat of trial {record.repeat_of})" if record.repeat_of else ""
            self.repeats_in_a_row = self.repeats_in_a_row + 1 if record.repeat_of else 0
            progress.line(f"  {self._label(record)} {status}{again}: {_shown(trial)} -> {stage} — {detail}")
        self.pending = []

    def _check(self, trial: Trial) -> None:
        """A trial whose params its pass refuses together (beyond what validation could list) is a
        failed trial with that one line, never run: like any failed trial, it does not stop the search."""
        if trial in self.refused:
            return
        try:
            check_trial(self.space, trial)
        except RecipeError as exc:
            self.refused[trial] = str(exc)

    def _label(self, record: TrialRecord) -> str:
        """`trial 7/12`; once Optuna has proposed a point again (measured once, not counted against
        the budget), `trial 9 (point 7/12)`."""
        total = self.budget or self.space.size
        point = len({r.trial for r in self.records[:record.number]})
        return f"trial {record.number}/{total}" if point == record.number else f"trial {record.number} (point {point}/{total})"

    def finish(self, group_by_node: bool, providers: str, progress: Progress, executor=None) -> RunReport:
        wall = time.perf_counter() - (self.started or time.perf_counter())
        order = execution_order(build_dag(self.expanded.stages))

        def section(report: RunReport) -> dict:
            return search_section(self, report, wall)

        report = finish_run(self.expanded, order, self.memo, self.run_dir, self.task_settings, group_by_node, section,
                            targets_on(executor, self.expanded, self.task_settings, progress), self.data_warnings)
        s = report.search
        best = s["best"]["stage"] if s.get("best") else "none within tolerance"
        progress.line(f"search {self.recipe.name}: {len(s['trials'])} trials ({s['counts']}), stopped: {s['stopped']}, "
                      f"frontier: {', '.join(s['frontier']) or 'none'}; best: {best}; wall {wall:.1f}s")
        return report

    def close(self) -> None:
        self.proposer.close()  # another driver may take the saved study from now on

    def failed(self, report: RunReport) -> list[StageResult]:
        """Stages outside the trials that failed; a failed trial is a search result, unless every trial failed."""
        trial_stages = set(self.expanded.stages) - set(self.recipe.stages)
        outside = [s for s in report.failed if s.name not in trial_stages]
        trials = [report.stage(r.stage) for r in self.records if r.stage]
        if self.records and not any(t is not None and t.status == "ok" for t in trials):
            return outside + [t for t in trials if t is not None]
        return outside

    def _room(self, slots: int) -> int:
        """How many trials the next round may start (0: the search is over, and why). The trial budget
        counts distinct points: a point Optuna proposes again costs nothing (its stage is measured
        once), and `trials: 6` that measured 3 models would not be the search the user paid for."""
        distinct = len({r.trial for r in self.records})
        if self.budget is not None and distinct >= self.budget:
            self.stopped = f"budget of {self.budget} trials spent"
            return 0
        if self.repeats_in_a_row >= max(REPEAT_LIMIT, self.budget or 0):
            self.stopped = f"the sampler proposed only points already tried, {self.repeats_in_a_row} in a row"
            return 0
        if self.settings.wall_time_s is not None and time.perf_counter() - self.started >= self.settings.wall_time_s:
            self.stopped = f"wall-time budget of {self.settings.wall_time_s:g}s spent"
            return 0
        unique = len({r.trial for r in self.records})
        if self.proposer.exhausted() or unique >= self.space.size and self.strategy == "optuna":
            self.stopped = "every point of the space tried"
            return 0
        room = slots if self.budget is None else min(slots, self.budget - distinct)
        return max(room, 0)


def _detail(result: StageResult | None, refused: str | None) -> str:
    if refused:
        return refused
    return result_detail(result) if result else "nothing to measure: every searched stage is off"


def _shown(trial: Trial) -> str:
    """A trial's params as progress shows them: those of a stage that is off played no part."""
    off = {key.rsplit(".", 1)[0] for key, value in trial.values if key.endswith(f".{ENABLED}") and value is False}
    return ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in trial.values
                     if k.rsplit(".", 1)[0] not in off or k.endswith(f".{ENABLED}"))


def describe_search(recipe: Recipe) -> str:
    """`optpipe validate`'s line for a search: its space, strategy and how many trials it would run."""
    space = SearchSpace(recipe)
    check_searched_values(space)
    settings = recipe.evaluate.search or SearchSettings()
    strategy, budget = resolve_strategy(space, settings, yes=True)
    runs = min(budget, space.size) if budget else space.size
    wall = f", at most {settings.wall_time_s:g}s" if settings.wall_time_s else ""
    if strategy == "grid" and budget is None and not settings.wall_time_s and space.size > GRID_CONFIRM_LIMIT:
        wall += f" (more than {GRID_CONFIRM_LIMIT}: `optpipe compile` asks for --yes)"
    return (f"search: {strategy} over {space.size} points ({', '.join(f'{k}: {len(v)}' for k, v in space.describe().items())}); "
            f"{'up to ' if strategy == 'optuna' or settings.wall_time_s else ''}{runs} trials{wall}")
