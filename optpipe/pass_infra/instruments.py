"""Cross-cutting hooks around stages (progress, timing, self-checks), kept out of the passes themselves.

An instrument subclasses `Instrument` and overrides the hooks it wants; the pass
manager calls them through `Instruments`, in this order for one compile:

    before_phase(label) -> phase_done(label, ok): work around the stages (the preflight, writing the report)
    run_start(stages)
    per stage:   before_stage(info) -> [after_stage(info, input, output)] -> stage_done(result)
    per stage:   before_evaluation(stage) -> after_evaluation(result)
    per swept stage (the frontier's latency curves): before_sweep(stage) -> sweep_done(stage, points, cached)
    per target:  before_target(kind, stage) -> target_done(result)
    step(task, done, total) whenever long work inside any of them progresses (total 0: not known)

`after_stage` runs only when the pass ran (not on a cache hit), after the contract
checks and before the output is published: an instrument there may add to
`output.info` or raise PassError to fail the stage (the numeric self-check does).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, TextIO

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

    def before_phase(self, label: str) -> None:
        """Work of the compile that is no stage starts: "preflight: ...", "report: ..." (the text before ':' names it)."""

    def phase_done(self, label: str, ok: bool) -> None:
        """It ended; not ok: it raised, and the error is reported elsewhere (the CLI's one line)."""

    def run_start(self, stages: list[str]) -> None: ...

    def before_stage(self, info: StageInfo) -> None: ...

    def after_stage(self, info: StageInfo, input: "ModelArtifact | None", output: "ModelArtifact") -> None:
        """The pass ran and passed the contract checks; `output` is not published yet."""

    def stage_done(self, result: "StageResult") -> None:
        """A stage finished: ok (run or cached), failed, or skipped because its parent did not finish."""

    def before_evaluation(self, stage: str) -> None: ...

    def after_evaluation(self, result: "StageResult") -> None: ...

    def before_sweep(self, stage: str) -> None:
        """The latency curves of a stage (evaluation's phase 2) start."""

    def sweep_done(self, stage: str, points: int, cached: bool, error: str | None = None) -> None:
        """The curves are measured (or read from the cache); `error`: why they are missing."""

    def before_target(self, kind: str, stage: str) -> None: ...

    def target_done(self, result: "TargetResult") -> None: ...

    def step(self, task: str, done: int, total: int) -> None:
        """Progress inside a stage: calibration batches, timing iterations, ...; `total` 0 when not known."""

    def run_end(self) -> None:
        """The compile is over, however it ended (an error or a Ctrl-C included): stop drawing."""


class Instruments(Instrument):
    """Several instruments called as one, in order."""

    def __init__(self, items: Iterable[Instrument] = ()):
        self.items = list(items)

    def before_phase(self, label: str) -> None:
        for item in self.items:
            item.before_phase(label)

    def phase_done(self, label: str, ok: bool) -> None:
        for item in self.items:
            item.phase_done(label, ok)

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """`before_phase(label)`, the block, `phase_done(label, ok)`: ok unless the block raised."""
        self.before_phase(label)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.phase_done(label, ok)

    def run_start(self, stages: list[str]) -> None:
        for item in self.items:
            item.run_start(stages)

    def run_end(self) -> None:
        for item in self.items:
            item.run_end()

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

    def before_sweep(self, stage: str) -> None:
        for item in self.items:
            item.before_sweep(stage)

    def sweep_done(self, stage: str, points: int, cached: bool, error: str | None = None) -> None:
        for item in self.items:
            item.sweep_done(stage, points, cached, error)

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
        parts.append(result.accuracy.figure())
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
    """One line per stage, evaluation, sweep and target as it ends, with its time; while one runs, a
    spinner with the step in progress (e.g. `latency batch 8 30/50`) and the seconds it has run.

    Two kinds of console change, told apart (issue 17):
    - progress: a step reported from inside the work (`step()`: a calibration batch, an exporter's
      phase, a timed block); the text says what is being done;
    - heartbeat: the running time alone, while one library call reports nothing (one
      torch.onnx.export trace, one onnxslim call). A ticker thread redraws the elapsed seconds on a
      terminal; where the console is no terminal (a log, a pipe, CI) rich draws no spinner, and the
      running step is printed as a line every HEARTBEAT_S instead, marked `still running` when no
      progress came since the last line. So the console never stays unchanged for HEARTBEAT_S,
      and a log says which of its lines are progress and which only the clock."""

    #: Without a terminal: at most one progress line this often (the issue-17 bound on silence is 10 s).
    HEARTBEAT_S = 8.0
    #: The ticker's period: the terminal's elapsed seconds and the log's heartbeat are checked this often.
    TICK_S = 0.25
    COLOURS = {"ok": "green", "cached": "cyan", "failed": "red", "skipped": "yellow"}

    def __init__(self, stream: TextIO | None = None, ticker: bool = True):
        # soft_wrap: a line stays one line in a log or a pipe (rich would wrap at 80 columns there).
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)
        self._status = None
        self._started = 0.0
        self._label = ""
        self._step: tuple[str, int, int] | None = None
        self._fresh = False  # a step came since the last line printed (progress, not a heartbeat)
        # Any line this console printed (a phase's end line too): the heartbeat counts from it, so a
        # log never goes HEARTBEAT_S without a line while something runs.
        self._last_line = time.perf_counter()
        self._shown = ""
        # The ticker redraws from its own thread; the hooks run on the compile's: one lock for both.
        self._lock = threading.RLock()
        self._ticker = ticker
        self._stop: threading.Event | None = None

    def before_phase(self, label: str) -> None:
        self._start(label)

    def phase_done(self, label: str, ok: bool) -> None:
        if ok:
            self._end(label.split(":")[0], "ok", "")
        else:  # the error's own line follows (the CLI's): the spinner only stops
            with self._lock:
                self._stop_ticker()
                if self._status is not None:
                    self._status.stop()
                    self._status = None

    def before_stage(self, info: StageInfo) -> None:
        self._start(f"{info.name}: {info.pass_.name}")

    def run_end(self) -> None:
        # A Ctrl-C leaves the phase running: its ticker would print "still running" after the CLI's
        # one `interrupted` line (seen in a log), so the ticker and the spinner stop here.
        with self._lock:
            self._stop_ticker()
            if self._status is not None:
                self._status.stop()
                self._status = None

    def stage_done(self, result: "StageResult") -> None:
        status = "cached" if result.status == "ok" and result.cached else result.status
        # The stage's own duration: one that never ran (its parent failed, it would not fit) took 0 s, not the time
        # since the last stage started.
        self._end(result.name, status, result.reason or "", took=result.duration_s)

    def before_evaluation(self, stage: str) -> None:
        self._start(f"evaluate {stage}: accuracy and latency")

    def after_evaluation(self, result: "StageResult") -> None:
        if result.status == "ok":
            self._end(f"evaluate {result.name}", "cached" if result.evaluation_cached else "ok", evaluation_summary(result))
        else:
            self._end(f"evaluate {result.name}", "failed", result.reason or "")

    def before_sweep(self, stage: str) -> None:
        self._start(f"curves {stage}: latency sweep")

    def sweep_done(self, stage: str, points: int, cached: bool, error: str | None = None) -> None:
        if error:
            self._end(f"curves {stage}", "failed", error)
        else:
            self._end(f"curves {stage}", "cached" if cached else "ok", f"{points} sweep points")

    def before_target(self, kind: str, stage: str) -> None:
        self._start(f"target {kind} {stage}: writing")

    def target_done(self, result: "TargetResult") -> None:
        self._end(f"target {result.kind} {result.stage}", result.status, target_summary(result))

    def step(self, task: str, done: int, total: int) -> None:
        # Kept, not drawn: a step may take microseconds, the ticker draws the latest. Never dropped: a
        # step that starts a long call right after a short one is what the console must show.
        with self._lock:
            if self._status is None:
                return
            self._step, self._fresh = (task, done, total), True
            if not self.console.is_terminal and time.perf_counter() - self._last_line >= self.HEARTBEAT_S:
                self._line(time.perf_counter())
            elif not self._ticker:
                self._draw(time.perf_counter())

    def tick(self, now: float | None = None) -> None:
        """What the ticker does every TICK_S: the elapsed seconds on a terminal, a heartbeat line in a log."""
        with self._lock:
            if self._status is None:
                return
            now = time.perf_counter() if now is None else now
            if self.console.is_terminal:
                self._draw(now)
            elif now - self._last_line >= max(self.HEARTBEAT_S, self.TICK_S):
                self._line(now)

    def _text(self) -> str:
        if self._step is None:
            return f"{self._label} ..."
        task, done, total = self._step
        count = f" {done}/{total}" if total else ""
        return f"{self._label} — {task}{count}"

    def _draw(self, now: float) -> None:
        text = f"{escape(self._text())} [dim]{now - self._started:.0f}s[/]"
        if text != self._shown:
            self._shown = text
            self._status.update(text)

    def _line(self, now: float) -> None:
        still = "" if self._fresh else ", still running"
        self._last_line, self._fresh = now, False
        self.console.print(f"  {'...':>7} {escape(self._text())} ({now - self._started:.0f}s{still})")

    def _start(self, label: str) -> None:
        with self._lock:
            self._stop_ticker()
            if self._status is not None:  # a phase that never ended (an error between the hooks)
                self._status.stop()
            self._started = time.perf_counter()
            self._label, self._step, self._fresh, self._shown = label, None, False, ""
            self._status = self.console.status(f"{escape(label)} ...")
            self._status.start()
            if self._ticker:
                self._stop = threading.Event()
                threading.Thread(target=self._run_ticker, args=(self._stop,), name="optpipe-console", daemon=True).start()

    def _run_ticker(self, stop: threading.Event) -> None:
        while not stop.wait(self.TICK_S):
            self.tick()

    def _stop_ticker(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def _end(self, what: str, status: str, detail: str, took: float | None = None) -> None:
        with self._lock:
            self._stop_ticker()
            if self._status is not None:
                self._status.stop()
                self._status = None
            took = time.perf_counter() - self._started if took is None else took
            colour = self.COLOURS.get(status, "white")
            extra = f" — {detail}" if detail else ""
            # escape: a reason quoting a path such as "[/tmp/x]" is text, not rich markup (it raised MarkupError).
            self.console.print(f"  [{colour}]{status:>7}[/] {escape(what)} ({took:.1f}s){escape(extra)}")
            self._last_line = time.perf_counter()


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

    def before_phase(self, label: str) -> None:
        self.events.append(("before_phase", label))

    def phase_done(self, label: str, ok: bool) -> None:
        self.events.append(("phase_done", label, ok))

    def before_sweep(self, stage: str) -> None:
        self.events.append(("before_sweep", stage))

    def sweep_done(self, stage: str, points: int, cached: bool, error: str | None = None) -> None:
        self.events.append(("sweep_done", stage, points, cached))

    def target_done(self, result: "TargetResult") -> None:
        self.events.append(("target_done", result.kind, result.stage, result.status))

    def step(self, task: str, done: int, total: int) -> None:
        self.events.append(("step", task, done, total))
