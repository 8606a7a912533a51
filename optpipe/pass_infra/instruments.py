"""Cross-cutting hooks around stages (progress, timing, self-checks), kept out of the passes themselves.

An instrument subclasses `Instrument` and overrides the hooks it wants; the pass
manager calls them through `Instruments`, in this order for one compile:

    run_start(stages)
    per stage:   before_stage(info) -> [after_stage(info, input, output)] -> stage_done(result)
    per stage:   before_evaluation(stage) -> after_evaluation(result)
    per target:  before_target(kind, stage) -> target_done(result)
    step(task, done, total) whenever long work inside any of them progresses

`after_stage` runs only when the pass ran (not on a cache hit), after the contract
checks and before the output is published: an instrument there may add to
`output.info` or raise PassError to fail the stage (the numeric self-check does).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, TextIO

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from optpipe.core.artifact import ModelArtifact
    from optpipe.pass_infra.pass_base import Pass, PassContext
    from optpipe.core.results import StageResult, TargetResult


@dataclass
class StageInfo:
    """The stage a hook is about: its name, its configured pass, and the context the pass runs with."""

    name: str
    pass_: "Pass"
    ctx: "PassContext"


class Instrument:
    """Hooks the pass manager calls; every hook is optional."""

    def run_start(self, stages: list[str]) -> None: ...

    def before_stage(self, info: StageInfo) -> None: ...

    def after_stage(self, info: StageInfo, input: "ModelArtifact | None", output: "ModelArtifact") -> None:
        """The pass ran and passed the contract checks; `output` is not published yet."""

    def stage_done(self, result: "StageResult") -> None:
        """A stage finished: ok (run or cached), failed, or skipped because its parent did not finish."""

    def before_evaluation(self, stage: str) -> None: ...

    def after_evaluation(self, result: "StageResult") -> None: ...

    def before_target(self, kind: str, stage: str) -> None: ...

    def target_done(self, result: "TargetResult") -> None: ...

    def step(self, task: str, done: int, total: int) -> None:
        """Progress inside a stage: calibration batches, timing iterations, ..."""


class Instruments(Instrument):
    """Several instruments called as one, in order."""

    def __init__(self, items: Iterable[Instrument] = ()):
        self.items = list(items)

    def run_start(self, stages: list[str]) -> None:
        for item in self.items:
            item.run_start(stages)

    def before_stage(self, info: StageInfo) -> None:
        for item in self.items:
            item.before_stage(info)

    def after_stage(self, info: StageInfo, input: "ModelArtifact | None", output: "ModelArtifact") -> None:
        for item in self.items:
            item.after_stage(info, input, output)

    def stage_done(self, result: "StageResult") -> None:
        for item in self.items:
            item.stage_done(result)

    def before_evaluation(self, stage: str) -> None:
        for item in self.items:
            item.before_evaluation(stage)

    def after_evaluation(self, result: "StageResult") -> None:
        for item in self.items:
            item.after_evaluation(result)

    def before_target(self, kind: str, stage: str) -> None:
        for item in self.items:
            item.before_target(kind, stage)

    def target_done(self, result: "TargetResult") -> None:
        for item in self.items:
            item.target_done(result)

    def step(self, task: str, done: int, total: int) -> None:
        for item in self.items:
            item.step(task, done, total)


def evaluation_summary(result: "StageResult") -> str:
    """One line for a measured stage: headline latency, worst cosine, coverage, warnings."""
    parts = []
    if result.headline:
        parts.append(f"p50 {result.headline.p50_ms:.2f} ms @ batch {result.headline.batch_size}")
    generation = result.generation
    if generation is not None and generation.rows:
        parts[:1] = [f"TTFT {generation.rows[0].ttft_ms:.1f} ms, "
                     + ", ".join(f"{r.decode_tokens_per_s:.0f} tok/s @ batch {r.batch_size}" for r in generation.rows)]
        if generation.next_token_agreement is not None:
            parts.append(f"next-token agreement {generation.next_token_agreement:.3f}")
        if generation.perplexity is not None:
            parts.append(f"perplexity {generation.perplexity:.3f}")
        if result.memory and result.memory.host_rss_bytes is not None:
            parts.append(f"peak {result.memory.host_rss_bytes / 1e6:.0f} MB")
    elif result.accuracy:
        parts.append(f"cosine {result.accuracy.worst_cosine:.5f}")
    if result.accuracy:
        if not result.accuracy.within_tolerance:
            parts.append("OUT OF TOLERANCE")
    if result.coverage:
        parts.append(result.coverage.summary())
    parts += [f"WARNING: {w}" for w in result.warnings]
    return ", ".join(parts)


def target_summary(result: "TargetResult") -> str:
    if result.ok:
        return f"{result.path} ({result.precision}" + (f", {result.provider})" if result.provider else ")")
    return result.reason or ""


class ConsoleProgress(Instrument):
    """One line per stage, evaluation and target as it ends, with its time; a spinner while it
    runs, showing the step in progress (e.g. `latency batch 8 30/50`). Where the console is no
    terminal (a log, a pipe, CI) rich draws no spinner: the step in progress is printed as a line
    every HEARTBEAT_S instead, so a long step (NNCF's accuracy control) is never a silence."""

    #: Redraw the spinner's text at most this often: a step may take microseconds.
    REFRESH_S = 0.1
    #: Without a terminal: at most one progress line this often (the issue-17 bound on silence is 10 s).
    HEARTBEAT_S = 8.0
    COLOURS = {"ok": "green", "cached": "cyan", "failed": "red", "skipped": "yellow"}

    def __init__(self, stream: TextIO | None = None):
        # soft_wrap: a line stays one line in a log or a pipe (rich would wrap at 80 columns there).
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)
        self._status = None
        self._started = 0.0
        self._label = ""
        self._last_step = 0.0
        self._last_line = 0.0

    def before_stage(self, info: StageInfo) -> None:
        self._start(f"{info.name}: {info.pass_.name}")

    def stage_done(self, result: "StageResult") -> None:
        status = "cached" if result.status == "ok" and result.cached else result.status
        self._end(result.name, status, result.reason or "")

    def before_evaluation(self, stage: str) -> None:
        self._start(f"evaluate {stage}: accuracy and latency")

    def after_evaluation(self, result: "StageResult") -> None:
        if result.status == "ok":
            self._end(f"evaluate {result.name}", "cached" if result.evaluation_cached else "ok", evaluation_summary(result))
        else:
            self._end(f"evaluate {result.name}", "failed", result.reason or "")

    def before_target(self, kind: str, stage: str) -> None:
        self._start(f"target {kind} {stage}: writing")

    def target_done(self, result: "TargetResult") -> None:
        self._end(f"target {result.kind} {result.stage}", result.status, target_summary(result))

    def step(self, task: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if self._status is None or (now - self._last_step < self.REFRESH_S and done < total):
            return
        self._last_step = now
        self._status.update(f"{self._label} — {task} {done}/{total}")
        if not self.console.is_terminal and now - self._last_line >= self.HEARTBEAT_S:
            self._last_line = now
            self.console.print(f"  {'...':>7} {escape(self._label)} — {escape(task)} {done}/{total} "
                               f"({now - self._started:.0f}s)")

    def _start(self, label: str) -> None:
        self._started = self._last_line = time.perf_counter()
        self._label = label
        self._status = self.console.status(f"{label} ...")
        self._status.start()

    def _end(self, what: str, status: str, detail: str) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        took = time.perf_counter() - self._started
        colour = self.COLOURS.get(status, "white")
        extra = f" — {detail}" if detail else ""
        # escape: a reason quoting a path such as "[/tmp/x]" is text, not rich markup (it raised MarkupError).
        self.console.print(f"  [{colour}]{status:>7}[/] {escape(what)} ({took:.1f}s){escape(extra)}")


class StepRecorder(Instrument):
    """Keeps every hook call as a tuple: for tests and for tools that want the progress as data."""

    def __init__(self):
        self.events: list[tuple] = []

    def before_stage(self, info: StageInfo) -> None:
        self.events.append(("before_stage", info.name, info.pass_.name))

    def after_stage(self, info: StageInfo, input: "ModelArtifact | None", output: "ModelArtifact") -> None:
        self.events.append(("after_stage", info.name))

    def stage_done(self, result: "StageResult") -> None:
        self.events.append(("stage_done", result.name, result.status))

    def before_evaluation(self, stage: str) -> None:
        self.events.append(("before_evaluation", stage))

    def after_evaluation(self, result: "StageResult") -> None:
        self.events.append(("after_evaluation", result.name, result.status))

    def target_done(self, result: "TargetResult") -> None:
        self.events.append(("target_done", result.kind, result.stage, result.status))

    def step(self, task: str, done: int, total: int) -> None:
        self.events.append(("step", task, done, total))
