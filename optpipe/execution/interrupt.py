"""What an interrupted run kept: an instrument that follows the run, and the one line saying so.

Every stage and evaluation that finished is already published in the cache
(atomically), so a rerun of the same command resumes from there.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from optpipe.errors import RunInterrupted
from optpipe.instruments import Instrument, StageInfo
from optpipe.results import StageResult


class KeptTracker(Instrument):
    """Records which stages and evaluations finished, and what was running."""

    def __init__(self) -> None:
        self.stages: list[str] = []
        self.evaluations: list[str] = []
        self.running: str | None = None

    def before_stage(self, info: StageInfo) -> None:
        self.running = f" during stage '{info.name}'"

    def stage_done(self, result: StageResult) -> None:
        self.running = None
        if result.status == "ok":
            self.stages.append(result.name)

    def before_evaluation(self, stage: str) -> None:
        self.running = f" during evaluate {stage}"

    def after_evaluation(self, result: StageResult) -> None:
        self.running = None
        if result.status == "ok":
            self.evaluations.append(result.name)

    def summary(self) -> str:
        if self.running:
            where = self.running
        else:  # between two hooks: say which phase
            where = " during evaluation" if self.evaluations else (" between stages" if self.stages else "")
        stages = f"{_count(self.stages, 'finished stage')} ({', '.join(self.stages)})" if self.stages else "no finished stage"
        evaluations = f" and {_count(self.evaluations, 'evaluation')}" if self.evaluations else ""
        return f"interrupted{where}: the cache keeps {stages}{evaluations}; rerun the same command to resume"


@contextlib.contextmanager
def explain_interruption(tracker: KeptTracker) -> Iterator[None]:
    """Turn Ctrl-C into RunInterrupted carrying the tracker's summary."""
    try:
        yield
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        raise RunInterrupted(tracker.summary()) from None


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"
