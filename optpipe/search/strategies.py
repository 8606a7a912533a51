"""Which trials to run next: the whole grid (or a seeded sample of it under a budget), or
Optuna's multi-objective samplers (TPE, NSGA-II) through its ask/tell interface."""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from optpipe.core.errors import RecipeError
from optpipe.core.results import StageResult
from optpipe.search.space import SearchSpace, Trial
from optpipe.recipe.search_spec import GRID_CONFIRM_LIMIT, SearchSettings
from optpipe.search.study import FAILED_ATTR, finished_trials, open_study

DIRECTIONS = {"latency": "minimize", "accuracy": "maximize", "size": "minimize"}


def resolve_strategy(space: SearchSpace, settings: SearchSettings, yes: bool) -> tuple[str, int | None]:
    """(grid | optuna, trial budget): auto picks the grid for small spaces; a big unbudgeted grid needs --yes."""
    strategy, budget = settings.strategy, settings.trials
    if strategy == "auto":
        strategy = "grid" if space.size <= GRID_CONFIRM_LIMIT or budget is not None and budget >= space.size else "optuna"
        if strategy == "optuna" and budget is None and settings.wall_time_s is None:
            budget = GRID_CONFIRM_LIMIT
    if strategy == "grid" and budget is None and settings.wall_time_s is None and space.size > GRID_CONFIRM_LIMIT and not yes:
        raise RecipeError(
            f"evaluate.search: the grid has {space.size} trials (more than {GRID_CONFIRM_LIMIT}); "
            f"pass --yes to run all {space.size}, or set evaluate.search.trials or wall_time_s"
        )
    if strategy == "optuna" and budget is None and settings.wall_time_s is None:
        raise RecipeError("evaluate.search: optuna needs a budget; set evaluate.search.trials or wall_time_s")
    return strategy, budget


class GridProposer:
    def __init__(self, space: SearchSpace, budget: int | None, seed: int):
        size = space.size
        if budget is not None and budget < size:
            # A seeded sample in grid order: the same trials on every rerun, spread over the space
            # (indices, not points, are sampled: a huge grid is never listed).
            indices = iter(sorted(_sample(random.Random(seed), size, budget)))
            self._pending = (space.point(i) for i in indices)
        else:
            self._pending = space.grid()
        self._next = next(self._pending, None)

    def ask(self, count: int) -> list[tuple[Any, Trial]]:
        batch = []
        while len(batch) < count and self._next is not None:
            batch.append((None, self._next))
            self._next = next(self._pending, None)
        return batch

    def exhausted(self) -> bool:
        return self._next is None

    def close(self) -> None:
        pass

    def resumed(self) -> list[Trial]:
        return []  # a grid is the same on every rerun: its finished trials are cache hits

    def tell(self, handle: Any, result: StageResult | None, refused: str | None = None) -> None:
        pass


def _sample(rng: random.Random, size: int, count: int) -> list[int]:
    """`count` distinct indices of range(size). random.sample takes len(range), which overflows past
    2**63 points (five searched params of 10,000 values): there, draws until `count` differ."""
    if size <= sys.maxsize:
        return rng.sample(range(size), count)
    chosen: set[int] = set()
    while len(chosen) < count:
        chosen.add(rng.randrange(size))
    return list(chosen)


class OptunaProposer:
    def __init__(self, space: SearchSpace, settings: SearchSettings, study: tuple[Path, str] | None = None, fresh: bool = False):
        """`study`: the study's log file and recipe key (optpipe.search.study), so a rerun resumes it;
        None: a study in memory only."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.space = space
        self.objectives = settings.objectives
        sampler_cls = {"tpe": optuna.samplers.TPESampler, "nsga2": optuna.samplers.NSGAIISampler}[settings.sampler]
        # Out of tolerance is a constraint (Trial.set_constraint), not a bad score: both samplers
        # then prefer feasible trials (the constraints_func reads what tell() stored).
        sampler = sampler_cls(seed=settings.seed)
        directions = [DIRECTIONS[o] for o in self.objectives]
        self.lock = None
        if study is None:
            self.study = optuna.create_study(directions=directions, sampler=sampler)
        else:
            self.study, self.lock = open_study(optuna, study[0], study[1], space, directions, sampler, fresh)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def resumed(self) -> list[Trial]:
        """The trials a saved study had finished, in order: the first trials of this run."""
        return [self.space.from_optuna(t.params) for t in finished_trials(self.optuna, self.study)]

    def ask(self, count: int) -> list[tuple[Any, Trial]]:
        batch = []
        for _ in range(count):
            handle = self.study.ask()
            params = {dim.key: handle.suggest_categorical(dim.key, dim.optuna_choices()) for dim in self.space.dimensions}
            batch.append((handle, self.space.from_optuna(params)))
        return batch

    def exhausted(self) -> bool:
        return False

    def tell(self, handle: Any, result: StageResult | None, refused: str | None = None) -> None:
        values = None if refused else objective_values(result, self.objectives)
        if values is None:
            reason = refused or ((result.reason or result.status) if result is not None else "nothing to measure")
            handle.set_user_attr(FAILED_ATTR, reason or "no latency")  # failed for a reason, not interrupted
            self.study.tell(handle, state=self.optuna.trial.TrialState.FAIL)
            return
        handle.set_constraint("tolerance", 0.0 if result.accuracy is None or result.accuracy.within_tolerance else 1.0)
        self.study.tell(handle, values)


def objective_values(result: StageResult | None, objectives: list[str]) -> list[float] | None:
    if result is None or result.status != "ok" or not result.latency:
        return None
    values = {
        "latency": result.latency[0].p50_ms,
        "accuracy": 1.0 - result.accuracy.error if result.accuracy else 1.0,  # the task's metric where there is one
        "size": float(result.size_bytes or 0),
    }
    return [values[o] for o in objectives]


def make_proposer(space: SearchSpace, settings: SearchSettings, strategy: str, budget: int | None,
                  study: tuple[Path, str] | None = None, fresh: bool = False):
    if strategy == "grid":
        return GridProposer(space, budget, settings.seed)
    return OptunaProposer(space, settings, study, fresh)
