"""Cold compile time and the longest silence of each stage: what a user watching the console waits.

    OPTPIPE_CACHE=$(mktemp -d) python bench/silence.py recipes/minilm.yaml

Compiles the recipe (cold when the cache is empty) with the console's progress plus a recorder of
every hook the console hears (stage start/end, evaluation start/end, every progress step), each with
its time. A silence is the time between two consecutive events: the console's text does not change
in it. Prints the wall time, the load and CPU class, and per stage/evaluation the longest silence
(issue 17: none over 10 s).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from optpipe.pass_infra.instruments import ConsoleProgress, Instrument


class Clocked(Instrument):
    def __init__(self):
        self.events: list[tuple[float, str, str]] = []
        self.scope = "start"

    def _mark(self, what: str, scope: str | None = None) -> None:
        if scope:
            self.scope = scope
        self.events.append((time.perf_counter(), self.scope, what))

    def before_stage(self, info) -> None:
        self._mark("start", f"stage {info.name}")

    def stage_done(self, result) -> None:
        self._mark(f"done {result.status}")

    def before_evaluation(self, stage: str) -> None:
        self._mark("start", f"evaluate {stage}")

    def after_evaluation(self, result) -> None:
        self._mark("done")

    def before_target(self, kind: str, stage: str) -> None:
        self._mark("start", f"target {kind} {stage}")

    def target_done(self, result) -> None:
        self._mark("done")

    def step(self, task: str, done: int, total: int) -> None:
        self._mark(task)


def main() -> int:
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.hardware.cpu_features import cpu_record
    from optpipe.safety.recipe_loading import load_recipe

    recipe = load_recipe(Path(sys.argv[1]))
    clock = Clocked()
    load = os.getloadavg()
    started = time.perf_counter()
    compile_recipe(recipe, RunOptions(instruments=[ConsoleProgress(), clock]))
    wall = time.perf_counter() - started
    worst: dict[str, tuple[float, str]] = {}
    previous = started
    for at, scope, what in clock.events:
        gap = at - previous
        if gap > worst.get(scope, (0.0, ""))[0]:
            worst[scope] = (gap, what)
        previous = at
    cpu = cpu_record()
    print(f"\ncompile {wall:.1f} s; load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}; CPU class {cpu['class']} "
          f"(OpenVINO: {cpu['openvino_class']})")
    print("| step | longest silence s | ended by |\n|---|---|---|")
    for scope, (gap, what) in worst.items():
        print(f"| {scope} | {gap:.1f}{' **>10**' if gap > 10 else ''} | {what} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
