"""An Optuna search's study on disk, so a rerun resumes it: Optuna's own JournalStorage with a
file backend (an append-only log of the study's events) in the run folder.

- Key: `<run>/studies/<recipe>-<space>.journal`, `recipe` a hash of the recipe without its
  search space and budget (model, data, stages, evaluation, objectives), `space` a hash of the
  searched dimensions with their values, the sampler and its seed. A rerun of the same search
  opens the same study: its finished trials are the first trials of the run (each an ordinary
  cached stage, so nothing is recomputed) and the sampler proposes the next ones knowing them.
- Widening the space (new values, a new sampler or seed) is a new study, because Optuna refuses
  a categorical param whose choices change within one study; it starts with every finished
  trial of the recipe's other studies whose params lie in the new space, so the sampler sees them.
- A trial the killed driver had asked but not told (still RUNNING in the log) is failed and its
  params queued again: the rerun measures it first (from the cache, if its stage finished).
- One driver per study at a time (a lock beside the log): a second is refused with one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from optpipe.core.artifact import sha256_json
from optpipe.core.errors import OptpipeError, first_line
from optpipe.recipe.schema import Recipe

STUDY_NAME = "optpipe"
FAILED_ATTR = "failed"  # set on a trial that failed for a reason; a FAIL without it was interrupted


def study_path(recipe: Recipe, space, settings, run_dir: Path) -> tuple[Path, str]:
    """The study's log file and the recipe part of its name (shared by the studies of wider spaces)."""
    document = recipe.model_dump(mode="json", by_alias=True)
    document.pop("output", None)
    for stage in document["stages"].values():
        stage.pop("search", None)
        stage.pop("optional", None)
    document["evaluate"]["search"] = {"objectives": list(settings.objectives)}
    recipe_key = sha256_json(document)[:16]
    space_key = sha256_json({"dimensions": [[d.key, list(d.values)] for d in space.dimensions],
                             "sampler": settings.sampler, "seed": settings.seed})[:16]
    return run_dir / "studies" / f"{recipe_key}-{space_key}.journal", recipe_key


def open_study(optuna, path: Path, recipe_key: str, space, directions: list[str], sampler, fresh: bool):
    """The study at `path` (created, or resumed), and the lock that keeps other drivers off it."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path) + ".driver.lock")  # not `.lock`: the journal backend takes that name for its own lock
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise OptpipeError(f"another optpipe compile is driving this search (lock {lock.lock_file}); wait for it to finish") from None
    if fresh:  # --force: the trials are recomputed, so is the study
        path.unlink(missing_ok=True)
    new = not path.exists()
    reading = path
    try:
        storage = JournalStorage(JournalFileBackend(str(path)))
        study = optuna.create_study(study_name=STUDY_NAME, storage=storage, directions=directions, sampler=sampler, load_if_exists=True)
        if new and not fresh:
            reading = None  # the recipe's other studies: _import_wider names the one it reads
            _import_wider(optuna, study, path, recipe_key, space)
        _requeue_interrupted(optuna, study)
    except _Unreadable as exc:
        lock.release()
        raise OptpipeError(_unreadable(exc.path, exc.__cause__)) from None
    except Exception as exc:  # noqa: BLE001  (whatever Optuna's reader raises on a file it cannot parse)
        lock.release()
        if reading is None:
            raise
        raise OptpipeError(_unreadable(reading, exc)) from None
    return study, lock


class _Unreadable(Exception):
    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path


def _unreadable(path: Path, exc: BaseException | None) -> str:
    """A study log cut or edited by hand (a torn disk, a text editor): the user's file, one line."""
    reason = first_line(exc) if exc is not None else "unreadable"
    return (f"{path}: the saved Optuna study cannot be read ({type(exc).__name__}: {reason}); delete it to start "
            f"the search's study afresh (its finished trials stay in the cache), or rerun with --force")


def finished_trials(optuna, study) -> list:
    """The study's finished trials in order: measured ones, and those that failed for a reason."""
    state = optuna.trial.TrialState
    return [t for t in study.get_trials(deepcopy=False)
            if t.state == state.COMPLETE or t.state == state.FAIL and FAILED_ATTR in t.user_attrs]


def _requeue_interrupted(optuna, study) -> None:
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial.params)


def _import_wider(optuna, study, path: Path, recipe_key: str, space) -> None:
    """Every finished trial of the recipe's other studies that lies in this space (a point found in
    two of them is taken from the first)."""
    from optuna.distributions import CategoricalDistribution
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    distributions = {dim.key: CategoricalDistribution(dim.optuna_choices()) for dim in space.dimensions}
    seen: set[Any] = set()
    for other in sorted(path.parent.glob(f"{recipe_key}-*.journal")):
        if other == path:
            continue
        try:
            old = optuna.load_study(study_name=STUDY_NAME, storage=JournalStorage(JournalFileBackend(str(other))))
            finished = finished_trials(optuna, old)
        except Exception as exc:  # noqa: BLE001  (as in open_study)
            raise _Unreadable(other) from exc
        points = set()
        for trial in finished:
            inside = set(trial.params) == set(distributions) and all(
                _member(trial.params[key], dist.choices) for key, dist in distributions.items())
            point = space.from_optuna(trial.params) if inside else None
            if point is None or point in seen:  # a point an earlier study gave already (its repeats are kept)
                continue
            points.add(point)
            study.add_trial(optuna.trial.create_trial(
                state=trial.state, values=trial.values, params=trial.params, distributions=distributions,
                user_attrs=trial.user_attrs, system_attrs=trial.system_attrs))
        seen |= points


def _member(value: Any, choices) -> bool:
    # True == 1 in Python: a bool choice must match a bool value, not a number.
    return any(value == choice and type(value) is type(choice) for choice in choices)
