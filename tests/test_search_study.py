"""The Optuna study persists in the run folder (Optuna's JournalStorage, file backend): a search
interrupted mid-trial resumes the same study, and a wider space starts from the trials already
finished."""
from __future__ import annotations

import copy
import io
from pathlib import Path

import optuna
import pytest
import yaml

from optpipe.execution.executors import LocalExecutor, Progress
from optpipe.safety.recipe_loading import load_recipe
from optpipe.search.runner import compile_recipes
from optpipe.search.study import STUDY_NAME

REPO = Path(__file__).resolve().parents[1]


def _data(trials: int) -> dict:
    data = yaml.safe_load((REPO / "recipes" / "tiny-search.yaml").read_text())
    data["model"]["path"] = str(REPO / "recipes" / "models")
    data["evaluate"].update(batch_sizes=[1], warmup=1, iterations=3)
    data["evaluate"]["search"] = {"strategy": "optuna", "sampler": "tpe", "trials": trials, "seed": 5,
                                  "objectives": ["accuracy", "size"]}
    return data


class _Interrupt(Progress):
    """Ctrl-C in the round after the given trial was told: the next trial is asked, never told."""

    def __init__(self, after_trial: int):
        super().__init__(io.StringIO())
        self.after, self.armed = f"trial {after_trial}/", False

    def line(self, text: str) -> None:
        if self.armed:
            raise KeyboardInterrupt
        super().line(text)
        self.armed = text.lstrip().startswith(self.after)


def _run(tmp_path: Path, data: dict, cache: Path, progress: Progress | None = None):
    data = copy.deepcopy(data)
    data["output"] = str(tmp_path / "run")
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    stream = progress or Progress(io.StringIO())
    [(report, _)] = compile_recipes([load_recipe(path)], LocalExecutor(), cache_dir=cache, progress=stream)
    return report, stream.stream.getvalue()


def _studies(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "run" / "studies").glob("*.journal"))


def _load(path: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return optuna.load_study(study_name=STUDY_NAME, storage=JournalStorage(JournalFileBackend(str(path))))


def _complete(study) -> list[tuple[dict, tuple]]:
    return [(t.params, tuple(t.values)) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def test_an_interrupted_search_resumes_its_study_and_a_wider_space_starts_from_its_trials(tmp_path):
    cache = tmp_path / "cache"
    data = _data(trials=5)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, data, cache, _Interrupt(after_trial=2))
    [journal] = _studies(tmp_path)
    killed = _load(journal)
    done = _complete(killed)
    asked = [t for t in killed.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len(done) == 2 and len(asked) == 1  # the third trial was asked when the driver died

    report, progress = _run(tmp_path, data, cache)
    assert _studies(tmp_path) == [journal]  # the same study, resumed
    study = _load(journal)
    trials = report.search["trials"]
    # The budget counts distinct points (a point TPE proposes again is listed, measured once).
    assert len(_distinct(trials)) == 5 and report.search["stopped"] == "budget of 5 trials spent"
    # Its first two trials are the killed run's, with the figures it measured; the trial the
    # killed driver had asked is proposed again first; the sampler went on from there.
    assert [t["params"] for t in trials[:2]] == [_trial_params(p) for p, _ in done]
    assert _complete(study)[:2] == done
    assert trials[2]["params"] == _trial_params(asked[0].params)
    assert progress.count("from the saved study") == 2
    assert len(_complete(study)) == len(trials) and sum(t.state == optuna.trial.TrialState.FAIL for t in study.trials) == 1

    # A rerun proposes nothing new: the study's trials, all from the cache.
    again, progress = _run(tmp_path, data, cache)
    assert [t["params"] for t in again.search["trials"]] == [t["params"] for t in trials]
    assert progress.count("from the saved study") == len(trials) and " ok pass " not in progress

    # A wider space: another study, which starts with the finished trials.
    wider = _data(trials=7)
    wider["stages"]["prune"]["search"]["amount"] = [0.2, 0.5, 0.35]
    widened, _ = _run(tmp_path, wider, cache)
    [new] = [p for p in _studies(tmp_path) if p != journal]
    assert [t["params"] for t in widened.search["trials"][:len(trials)]] == [t["params"] for t in trials]
    assert len(_distinct(widened.search["trials"])) == 7
    assert _complete(_load(new))[:len(trials)] == _complete(study)


def _distinct(trials: list[dict]) -> list[dict]:
    return [t for t in trials if t["repeat_of"] is None]


def _trial_params(params: dict) -> dict:
    """A study's params as the report lists them (those of a stage that was off are left out)."""
    off = {key.rsplit(".", 1)[0] for key, value in params.items() if key.endswith(".enabled") and value is False}
    return {k: v for k, v in params.items() if k.endswith(".enabled") or k.rsplit(".", 1)[0] not in off}
