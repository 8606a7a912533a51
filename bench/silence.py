"""Cold compile time and the longest silence of each step: what a user watching the console waits.

    OPTPIPE_CACHE=$(mktemp -d) python bench/silence.py recipes/minilm.yaml

Compiles the recipe (cold when the cache is empty) with the console's progress, as `optpipe
compile` shows it, plus a recorder of every hook the console hears (stage, evaluation, sweep and
target start/end, every progress step), each with its time. Two silences per step (issue 17):

- progress silence: the time between two consecutive events: nothing new was reported from the
  work in it (a heartbeat does not end it). This is the figure the issue's 10 s bound is about.
- console silence: the time between two lines the console printed, as a user reading a log (no
  terminal: CI, a pipe) sees them: progress lines and heartbeat lines (`still running`, every
  ConsoleProgress.HEARTBEAT_S). On a terminal the spinner's elapsed seconds change every second.

The console is written to stderr as usual (through a clock on each line). Prints the wall time,
the load and CPU class, and per step both silences.
"""
from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

from optpipe.pass_infra.instruments import ConsoleProgress, Instrument


class Clocked(Instrument):
    """Every hook the console hears, with its time and the step (scope) it belongs to."""

    def __init__(self):
        self.events: list[tuple[float, str, str]] = []
        self.scope = "start"

    def _mark(self, what: str, scope: str | None = None) -> None:
        if scope:
            self.scope = scope
        self.events.append((time.perf_counter(), self.scope, what))

    def before_phase(self, label: str) -> None:
        self._mark("start", label.split(":")[0])

    def phase_done(self, label: str, ok: bool) -> None:
        self._mark("done")

    def before_stage(self, info) -> None:
        self._mark("start", f"stage {info.name}")

    def stage_done(self, result) -> None:
        self._mark(f"done {result.status}")

    def before_evaluation(self, stage: str) -> None:
        self._mark("start", f"evaluate {stage}")

    def after_evaluation(self, result) -> None:
        self._mark("done")

    def before_sweep(self, stage: str) -> None:
        self._mark("start", f"curves {stage}")

    def sweep_done(self, stage: str, points: int, cached: bool, error: str | None = None) -> None:
        self._mark("done")

    def before_target(self, kind: str, stage: str) -> None:
        self._mark("start", f"target {kind} {stage}")

    def target_done(self, result) -> None:
        self._mark("done")

    def step(self, task: str, done: int, total: int) -> None:
        self._mark(task)


class ClockedLines(io.TextIOBase):
    """The console's stream: each complete line gets its time (and goes on to stderr)."""

    def __init__(self, clock: Clocked):
        self.clock, self.lines, self._pending = clock, [], ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        sys.stderr.write(text)
        self._pending += text
        *done, self._pending = self._pending.split("\n")
        now = time.perf_counter()
        self.lines += [(now, self.clock.scope, line.strip()) for line in done]
        return len(text)


def longest_gaps(events: list[tuple[float, str, str]], started: float) -> dict[str, tuple[float, str]]:
    """Per scope, the longest time between an event and the one before it (and the event that ended it)."""
    worst: dict[str, tuple[float, str]] = {}
    previous = started
    for at, scope, what in events:
        gap = at - previous
        if gap > worst.get(scope, (0.0, ""))[0]:
            worst[scope] = (gap, what)
        previous = at
    return worst


def main() -> int:
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.hardware.cpu_features import cpu_record
    from optpipe.safety.recipe_loading import load_recipe

    if len(sys.argv) != 2:
        print("usage: OPTPIPE_CACHE=$(mktemp -d) python bench/silence.py RECIPE.yaml", file=sys.stderr)
        return 2
    recipe = load_recipe(Path(sys.argv[1]))
    clock = Clocked()
    stream = ClockedLines(clock)
    load = os.getloadavg()
    started = time.perf_counter()
    compile_recipe(recipe, RunOptions(instruments=[clock, ConsoleProgress(stream)]))
    wall = time.perf_counter() - started
    progress = longest_gaps(clock.events, started)
    console = longest_gaps(stream.lines, started)
    cpu = cpu_record()
    first = clock.events[0][0] - started if clock.events else wall
    tail = started + wall - clock.events[-1][0] if clock.events else 0.0
    print(f"\ncompile {wall:.1f} s; load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}; CPU class {cpu['class']} "
          f"(OpenVINO: {cpu['openvino_class']}); {len(clock.events)} progress events, {len(stream.lines)} console lines; "
          f"before the first event {first:.1f} s, after the last {tail:.1f} s")
    print("| step | longest progress silence s | ended by | longest console silence s (no terminal) |\n|---|---|---|---|")
    for scope, (gap, what) in progress.items():
        shown = console.get(scope, (0.0, ""))[0]
        print(f"| {scope} | {gap:.1f}{' **>10**' if gap > 10 else ''} | {what[:70]} | {shown:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
