"""What an interrupted run kept: an instrument that follows the run, and the one line saying so.

Every stage and evaluation that finished is already published in the cache
(atomically), so a rerun of the same command resumes from there.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from optpipe.core.errors import RunInterrupted
from optpipe.pass_infra.instruments import Instrument, StageInfo
from optpipe.core.results import StageResult


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


def interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """A Ctrl-C anywhere in an exception's cause/context chain: libraries (torch importing its
    exporter, for one) catch KeyboardInterrupt and raise something else while handling it."""
    from optpipe.safety.os_errors import chain

    return next((link for link in chain(exc) if isinstance(link, KeyboardInterrupt)), None)


class InterruptWatch:
    """Notices a Ctrl-C during a stage even when a library swallowed it entirely (caught it and
    went on, e.g. an exporter falling back to the next one): the signal was counted
    (optpipe.execution.signals), so the stage's result, made under an interrupt, is not kept."""

    def __init__(self) -> None:
        from optpipe.execution.signals import interrupts_received

        self._count = interrupts_received
        self._mark = interrupts_received()

    def check(self) -> None:
        if self._count() > self._mark:
            raise KeyboardInterrupt()


def escalate(exc: BaseException, cache_root: Path | None = None, watch: InterruptWatch | None = None) -> None:
    """Raise what must stop the whole run instead of failing one stage: a Ctrl-C hidden in the
    chain or counted by `watch` (exit 130), or a full or read-only disk (exit 2, one line naming
    `cache_root`, where stages and evaluations write): in the chain's errno, or the disk full now, whatever
    words the failing library used."""
    from optpipe.safety.os_errors import FolderError, describe, disk_error_in, full_disk_at

    if watch is not None:
        watch.check()
    interrupt = interrupt_in(exc)
    if isinstance(interrupt, RunInterrupted):
        raise interrupt
    if interrupt is not None:
        raise KeyboardInterrupt() from None
    disk = disk_error_in(exc) or full_disk_at(cache_root)
    if disk is not None:
        raise FolderError(describe(disk, "cache folder" if cache_root else "", cache_root)) from None


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"
