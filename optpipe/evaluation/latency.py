"""Latency: percentiles over timed iterations after warm-up, threads pinned, with a verdict on the noise.

Polygraphy logs only the mean of its timings; percentiles are computed here.

Timing runs in blocks. With a `baseline` (PyTorch eager), the blocks alternate
candidate / baseline, so both are timed over the same minutes on the same inputs:
the speed-up is the ratio of two figures taken side by side, not of two taken
minutes apart on a shared machine (a small CNN once showed "812x faster than
eager" because eager alone was timed while the machine was busy).

Each figure says whether the machine was busy while it was timed: a long tail
(p90/p50), per-block medians that disagree (run-to-run spread), or other processes
taking a quarter of its CPUs meanwhile (a steady slowdown, which the first two miss;
see optpipe.evaluation.cpu_contention) mark it `unreliable`, with the reason, and
the report marks the speed-up computed from it.

Timing stops early once the median is known well enough (its 95% confidence
interval, from order statistics, within CI_TARGET of it for every timed runnable):
on a quiet machine a stage needs far fewer than `iterations` runs. On a machine whose
timings spread (a cloud VM's steal time) that interval may not come within reach: a
figure then stops when its timed calls have taken `budget_s` (after MIN_ITERATIONS),
and records the interval it did reach (`Latency.interval`, `Latency.stopped`), which
the report shows, rather than spend 50 slow calls on a figure that stays as wide.

Warm-up ends on a block that is no faster than the block before it: steady state by that rule's
own definition, so that block is the first timed block (when every runnable's warm-up settled;
the candidate's comes first, the baseline's second, and the timed blocks go on alternating).
A `Warmth` remembers, within a process, which runnables were warmed on which input shapes: one
warmed on these very shapes (PyTorch eager, timed again beside every stage) makes no untimed
calls, and its first block counts as settled only when it agrees with the median it had last time
(a slower block, an idle model gone cold or a machine gone busy, is settled by the rule above);
one warmed on other shapes (a session going from sweep point to sweep point) makes one untimed
call on the new shape, for its allocations.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional
from weakref import WeakKeyDictionary

import numpy as np

from optpipe.evaluation import cpu_contention
from optpipe.core.results import Latency
from optpipe.core.runtime import Feeds, Outputs, pinned_threads

Run = Callable[[Feeds], Outputs]
Clock = Callable[[], float]

BLOCK = 5  # timed runs per block; candidate and baseline alternate block by block
MIN_ITERATIONS = 15  # at least three blocks: the run-to-run spread needs several
CI_TARGET = 0.03  # stop when the median's 95% interval is within ±3% of it
# Busy-machine thresholds. On this project's 2-core machine, quiet, ORT and eager figures showed
# p90/p50 of 1.02-1.3 and block spreads under 0.25; with another process hogging a core they went
# past 1.6 and 0.5. A figure beyond either is flagged, not dropped.
BUSY_TAIL = 1.5  # p90 / p50
BUSY_SPREAD = 0.5  # (max - min) / median of the per-block medians
# Other processes' share of this process's CPUs while it timed (optpipe.evaluation.cpu_contention).
# Quiet, this machine's background stayed under 5%; one busy process on one of its two cores is 50%.
BUSY_OTHERS = 0.25
# The container's CPU quota holding the threads back while timed: each wait lands inside a timed call (x86-amx,
# ORT MiniLM at 2 threads in a cgroup of 1.5 CPUs: p90 1.8-2.2x its p50, docs/benchmarks.md). A few percent
# already moves a median of short calls; quiet, within the quota, it stays at 0.
BUSY_THROTTLED = 0.05
# Warm-up runs until a block is no faster than the one before (caches, lazy initialisation, JIT kernels).
WARM_SETTLED = 0.9  # a block at least 10% faster than the previous means still warming up
WARM_CAP_S = 3.0  # give up waiting for it to settle after this long (the busy flags then tell)
# The untimed runs before that: `warmup` of them, or as many as fit in this long (at least one). What
# warms a runtime up is its first calls on a shape (allocations, kernel choice), and the settling
# blocks after them check it is done; 10 calls of a 300 ms batch are 3 s spent on nothing more.
WARMUP_S = 0.5
# A settling block is BLOCK runs, or fewer (at least 2) when that many would take over this long:
# a 300 ms batch-16 call would otherwise spend 3 s in two blocks of 5.
WARM_BLOCK_S = 0.5
# A runnable already warmed on other shapes makes this many untimed calls on a new one (at most
# `warmup`). Measured on MiniLM (docs/compile-time.md): a new batch or sequence length's first call
# took 1.0-1.2x the next ones' in ORT, 1.3-3.5x in OpenVINO, whose second call was already steady; a
# session's very first call (2.5-3x) is a fresh runnable's and gets `warmup`.
NEW_SHAPE_CALLS = 1


class Warmth:
    """Which runnables this process warmed on which input shapes, with their last median (ms).

    Keyed weakly by the runnable itself: a session's runner that is gone leaves nothing behind, and a
    new one (a new session, even of the same model) is warmed from scratch."""

    def __init__(self):
        self._seen: WeakKeyDictionary[Run, dict[tuple, float | None]] = WeakKeyDictionary()

    def untimed_calls(self, run: Run, feeds: Feeds, warmup: int) -> int:
        shapes = self._seen.get(run)
        if shapes is None:
            return warmup
        return 0 if _shape_key(feeds) in shapes else min(warmup, NEW_SHAPE_CALLS)

    def steady_ms(self, run: Run, feeds: Feeds) -> float | None:
        return self._seen.get(run, {}).get(_shape_key(feeds))

    def record(self, run: Run, feeds: Feeds, steady_ms: float | None = None) -> None:
        """`run` had its untimed calls on these feeds' shapes (and, when known, settled at `steady_ms`)."""
        shapes = self._seen.setdefault(run, {})
        key = _shape_key(feeds)
        shapes[key] = steady_ms if steady_ms is not None else shapes.get(key)


def measure(
    run: Run,
    feeds: Feeds,
    warmup: int,
    iterations: int,
    threads: int,
    provider: str,
    progress: Callable[[int, int], None] | None = None,
    baseline: Run | None = None,
    adaptive: bool = True,
    clock: Clock = time.perf_counter,
    warmth: Warmth | None = None,
    warming: Callable[[int], None] | None = None,
    budget_s: float | None = None,
) -> Latency:
    """Time `run` (and `baseline`, interleaved) on `feeds`: at most `iterations` timed runs each.

    `progress(done, total)` is told after warm-up and after every timed call of the candidate;
    `warming(calls)` after every warm-up call (both between calls, outside each call's timed span:
    a batch-16 call of a loaded machine takes seconds, the console shows each).
    `clock` is injectable so tests can make the machine look steady or busy. `warmth`: what this
    process already warmed (None: nothing, every runnable gets the full warm-up). `budget_s`
    (adaptive timing only): stop once the timed blocks took this long, at MIN_ITERATIONS or later.
    """
    warmth = warmth if warmth is not None else Warmth()
    runners = {"candidate": run} | ({"baseline": baseline} if baseline is not None else {})
    blocks: dict[str, list[np.ndarray]] = {name: [] for name in runners}
    load, cpu_start = _load_average(), cpu_contention.snapshot()
    warm_calls = [0]

    def warm_tick() -> None:
        warm_calls[0] += 1
        if warming is not None:
            warming(warm_calls[0])

    with pinned_threads(threads):
        settled = {name: warm_up(fn, feeds, warmup, clock, warmth, warm_tick) for name, fn in runners.items()}
        if all(block is not None for block in settled.values()):
            # Candidate's then baseline's, as warmed: the first pair of timed blocks; the next pair starts
            # with the baseline (the parity below), as when both were timed after warm-up.
            for name, block in settled.items():
                blocks[name].append(block[:iterations])
        done = len(blocks["candidate"][0]) if blocks["candidate"] else 0
        timed_start, stopped = clock(), "iterations"
        while done < iterations:
            if progress is not None:
                progress(done, iterations)
            n = min(BLOCK, iterations - done)
            if adaptive and done < MIN_ITERATIONS:
                # Land on MIN_ITERATIONS, the first chance to stop, when the settled block was shorter than
                # BLOCK (slow calls): 3 + 5 + 5 + 2 runs, not 3 + 5 + 5 + 5. Never a block of one run.
                n = min(n, max(2, MIN_ITERATIONS - done))
            order = list(runners) if len(blocks["candidate"]) % 2 == 0 else list(reversed(runners))
            for name in order:
                tick = _counter(progress, done, iterations) if name == "candidate" and progress is not None else None
                blocks[name].append(_time_block(runners[name], feeds, n, clock, tick))
            done += n
            if adaptive and done >= MIN_ITERATIONS:
                if all(median_is_tight(np.concatenate(b)) for b in blocks.values()):
                    stopped = "interval"
                    break
                if budget_s is not None and clock() - timed_start >= budget_s:
                    stopped = "budget"
                    break
        if progress is not None:
            progress(iterations, iterations)
    for name, fn in runners.items():
        # The median it settled at, for the next warm-up on these shapes to compare with (none when
        # its warm-up never settled).
        steady = float(np.median(np.concatenate(blocks[name]))) if settled[name] is not None else None
        warmth.record(fn, feeds, steady)
    load = max(load, _load_average()) if load is not None else None
    others = cpu_contention.shares(cpu_start, cpu_contention.snapshot())
    latency = _summarise(blocks["candidate"], feeds, provider, load, others, stopped if adaptive else None)
    if baseline is not None:
        eager = _summarise(blocks["baseline"], feeds, "baseline", load, others)
        reasons = [r for r in (latency.unreliable, eager.unreliable and f"eager beside it: {eager.unreliable}") if r]
        latency = latency.model_copy(update={
            "eager_p50_ms": eager.p50_ms, "eager_p90_ms": eager.p90_ms, "unreliable": "; ".join(reasons) or None})
    return latency


def _counter(progress: Callable[[int, int], None], done: int, total: int) -> Callable[[], None]:
    calls = [done]

    def tick() -> None:
        calls[0] += 1
        progress(calls[0], total)

    return tick


def warm_up(run: Run, feeds: Feeds, warmup: int, clock: Clock = time.perf_counter,
            warmth: Warmth | None = None, tick: Callable[[], None] | None = None) -> np.ndarray | None:
    """Untimed runs, then blocks until one is no faster than the block before it (or WARM_CAP_S).

    Returns that settled block's times (ms), steady state by the rule's definition, or None when
    it never settled. The untimed runs: `warmup` of them (fewer when they take over WARMUP_S), fewer
    for a runnable `warmth` has seen (none on the same shapes, where its first block settles it if
    it is within WARM_SETTLED of the median it settled at then)."""
    calls = warmth.untimed_calls(run, feeds, warmup) if warmth is not None else warmup
    steady = warmth.steady_ms(run, feeds) if warmth is not None else None
    start = last = clock()
    call_s = steady / 1e3 if steady is not None else None  # how long a call takes: sizes the settling blocks
    for i in range(calls):
        if i and last - start >= WARMUP_S:
            break
        run(feeds)
        call_s, last = clock() - last, clock()
        if tick is not None:
            tick()
    start, previous = clock(), None
    size = _settle_block(call_s)
    while clock() - start < WARM_CAP_S:
        block = _time_block(run, feeds, size, clock, tick)
        current = float(np.median(block))
        size = _settle_block(current / 1e3)
        if previous is not None and current >= WARM_SETTLED * previous:
            return block
        if previous is None and steady is not None and WARM_SETTLED * steady <= current <= steady / WARM_SETTLED:
            return block  # as fast as it was when it last settled: still steady
        previous = current
    return None


def _settle_block(call_s: float | None) -> int:
    """Runs per settling block: BLOCK, fewer (at least 2) for calls so long that BLOCK exceed WARM_BLOCK_S."""
    if call_s is None or call_s <= 0:
        return BLOCK
    return max(2, min(BLOCK, int(WARM_BLOCK_S / call_s)))


def warm_for(run: Run, feeds: Feeds, seconds: float, clock: Clock = time.perf_counter,
             progress: Callable[[int, int], None] | None = None) -> None:
    """Run untimed for `seconds` (at least once): for runtimes whose first seconds are slow, not their first calls.
    `progress(calls, 0)` after each call."""
    start, calls = clock(), 0
    while calls == 0 or clock() - start < seconds:
        run(feeds)
        calls += 1
        if progress is not None:
            progress(calls, 0)


def median_is_tight(times: np.ndarray, target: float = CI_TARGET) -> bool:
    """The distribution-free 95% interval of the median (order statistics) lies within ±target of it."""
    interval = median_interval(times)
    return interval is not None and interval <= target


def median_interval(times: np.ndarray) -> float | None:
    """Half the width of the median's distribution-free 95% interval (order statistics), as a fraction
    of the median; None when too few runs bound it (fewer than 8) or the median is not positive."""
    n = len(times)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = int(math.floor(n / 2 - half)), int(math.ceil(n / 2 + half))
    if lo < 0 or hi >= n:
        return None
    ordered = np.sort(times)
    median = float(np.median(ordered))
    return float((ordered[hi] - ordered[lo]) / 2 / median) if median > 0 else None


def busy_reason(times_ms: np.ndarray, block_medians: list[float], others_cpu: float | None = None,
                throttled: float | None = None) -> str | None:
    """Why these timings (or the CPU time other processes took meanwhile, or the container's quota held back)
    say the machine was busy, or None when they look steady."""
    p50 = float(np.percentile(times_ms, 50))
    if p50 <= 0:
        return None
    reasons = []
    if others_cpu is not None and others_cpu > BUSY_OTHERS:
        reasons.append(f"other processes took {others_cpu:.0%} of its CPUs > {BUSY_OTHERS:.0%}")
    if throttled is not None and throttled > BUSY_THROTTLED:
        reasons.append(f"the container's CPU quota held it back {throttled:.0%} of its CPU time > {BUSY_THROTTLED:.0%}")
    tail = float(np.percentile(times_ms, 90)) / p50
    if tail > BUSY_TAIL:
        reasons.append(f"p90/p50 {tail:.2f} > {BUSY_TAIL}")
    if len(block_medians) >= 2:
        spread = (max(block_medians) - min(block_medians)) / p50
        if spread > BUSY_SPREAD:
            reasons.append(f"run-to-run spread {spread:.0%} > {BUSY_SPREAD:.0%}")
    return "machine busy: " + ", ".join(reasons) if reasons else None


def _time_block(run: Run, feeds: Feeds, n: int, clock: Clock, tick: Callable[[], None] | None = None) -> np.ndarray:
    """`n` calls, each timed alone; `tick` between them, outside any call's span."""
    times = np.empty(n)
    for i in range(n):
        start = clock()
        run(feeds)
        times[i] = clock() - start
        if tick is not None:
            tick()
    return times * 1e3


def _summarise(blocks: list[np.ndarray], feeds: Feeds, provider: str, load: Optional[float],
               others: tuple[Optional[float], Optional[float]] = (None, None), stopped: Optional[str] = None) -> Latency:
    """`others`: other processes' share of the CPUs and the quota's throttled share while timed (cpu_contention)."""
    ms = np.concatenate(blocks)
    medians = [float(np.median(b)) for b in blocks]
    batch = len(next(iter(feeds.values())))
    p50 = float(np.percentile(ms, 50))
    return Latency(
        batch_size=batch,
        shape={name: list(array.shape) for name, array in feeds.items()},
        p50_ms=p50,
        p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)),
        mean_ms=float(ms.mean()),
        throughput=batch / (p50 / 1e3) if p50 > 0 else 0.0,
        iterations=len(ms),
        provider=provider,
        spread=(max(medians) - min(medians)) / p50 if len(medians) >= 2 and p50 > 0 else None,
        interval=median_interval(ms),
        stopped=stopped,
        load_average=load,
        others_cpu=others[0],
        throttled=others[1],
        unreliable=busy_reason(ms, medians, *others),
    )


def _shape_key(feeds: Feeds) -> tuple:
    return tuple(sorted((name, array.shape, str(array.dtype)) for name, array in feeds.items()))


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
