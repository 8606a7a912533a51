"""Cross-cutting hooks around stages (progress, timing), kept out of the passes themselves."""
from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console


class Instrument:
    """Hooks the pass manager calls; every hook is optional."""

    def run_start(self, stages: list[str]) -> None: ...
    def stage_start(self, stage: str, what: str) -> None: ...
    def stage_end(self, stage: str, status: str, detail: str = "") -> None: ...
    def step(self, task: str, done: int, total: int) -> None:
        """Progress inside a stage: calibration batches, timing iterations, ..."""


class ConsoleProgress(Instrument):
    """One line per stage as it starts and ends, with its time; a spinner while it runs,
    showing the step in progress (e.g. `latency batch 8 30/50`)."""

    #: Redraw the spinner's text at most this often: a step may take microseconds.
    REFRESH_S = 0.1

    def __init__(self, stream: TextIO | None = None):
        self.console = Console(file=stream or sys.stderr, highlight=False)
        self._status = None
        self._started = 0.0
        self._total = 0
        self._done = 0
        self._label = ""
        self._last_step = 0.0

    def run_start(self, stages: list[str]) -> None:
        self._total = len(stages)
        self._done = 0

    def stage_start(self, stage: str, what: str) -> None:
        self._started = time.perf_counter()
        self._label = f"{stage}: {what}"
        self._status = self.console.status(f"{self._label} ...")
        self._status.start()

    def step(self, task: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if self._status is None or (now - self._last_step < self.REFRESH_S and done < total):
            return
        self._last_step = now
        self._status.update(f"{self._label} — {task} {done}/{total}")

    def stage_end(self, stage: str, status: str, detail: str = "") -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        self._done += 1
        took = time.perf_counter() - self._started
        colour = {"ok": "green", "cached": "cyan", "failed": "red", "skipped": "yellow"}.get(status, "white")
        extra = f" — {detail}" if detail else ""
        self.console.print(f"  [{colour}]{status:>7}[/] {stage} ({took:.1f}s){extra}")


class StepRecorder(Instrument):
    """Keeps every hook call: for tests and for tools that want the progress as data."""

    def __init__(self):
        self.events: list[tuple] = []

    def stage_start(self, stage: str, what: str) -> None:
        self.events.append(("stage_start", stage, what))

    def stage_end(self, stage: str, status: str, detail: str = "") -> None:
        self.events.append(("stage_end", stage, status))

    def step(self, task: str, done: int, total: int) -> None:
        self.events.append(("step", task, done, total))
