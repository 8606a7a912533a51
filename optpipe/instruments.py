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


class ConsoleProgress(Instrument):
    """One line per stage as it starts and ends, with its time; a spinner while it runs."""

    def __init__(self, stream: TextIO | None = None):
        self.console = Console(file=stream or sys.stderr, highlight=False)
        self._status = None
        self._started = 0.0
        self._total = 0
        self._done = 0

    def run_start(self, stages: list[str]) -> None:
        self._total = len(stages)
        self._done = 0

    def stage_start(self, stage: str, what: str) -> None:
        self._started = time.perf_counter()
        self._status = self.console.status(f"{stage}: {what} ...")
        self._status.start()

    def stage_end(self, stage: str, status: str, detail: str = "") -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        self._done += 1
        took = time.perf_counter() - self._started
        colour = {"ok": "green", "cached": "cyan", "failed": "red", "skipped": "yellow"}.get(status, "white")
        extra = f" — {detail}" if detail else ""
        self.console.print(f"  [{colour}]{status:>7}[/] {stage} ({took:.1f}s){extra}")
