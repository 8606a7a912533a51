"""Latency protocol: eager timed interleaved, busy-machine flags, adaptive stopping (fake clocks and a real hog)."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from optpipe.evaluation.latency import BLOCK, CI_TARGET, MIN_ITERATIONS, Warmth, busy_reason, measure, median_interval, median_is_tight
from optpipe.core.results import Latency

FEEDS = {"x": np.zeros((2, 3), dtype=np.float32)}


class FakeClock:
    """A clock that only moves when a fake model runs: each run takes the next scripted duration."""

    def __init__(self):
        self.now = 0.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def model(self, name: str, durations_ms):
        durations = iter(durations_ms)

        def run(feeds):
            self.log.append(name)
            self.now += next(durations) / 1e3
            return {}

        return run


def steady(ms: float, jitter: float = 0.005, seed: int = 0):
    rng = np.random.default_rng(seed)
    while True:
        yield ms * (1 + rng.uniform(-jitter, jitter))


def with_spikes(ms: float, every: int, factor: float):
    i = 0
    while True:
        i += 1
        yield ms * factor if i % every == 0 else ms


def test_steady_machine_is_not_flagged_and_eager_is_timed_beside_the_stage():
    clock = FakeClock()
    lat = measure(clock.model("stage", steady(4.0)), FEEDS, warmup=2, iterations=60, threads=1, provider="cpu",
                  baseline=clock.model("eager", steady(10.0, seed=1)), adaptive=False, clock=clock)
    assert lat.unreliable is None
    assert lat.p50_ms == pytest_approx(4.0, 0.01) and lat.eager_p50_ms == pytest_approx(10.0, 0.01)
    assert lat.speedup_vs_eager == pytest_approx(2.5, 0.02)
    assert lat.spread is not None and lat.spread < 0.05 and lat.iterations == 60
    # Each warm-up: 2 untimed runs, then two blocks that agree; the second of them is timed.
    assert clock.log[:2 + 2 * BLOCK] == ["stage"] * (2 + 2 * BLOCK)
    assert clock.log[2 + 2 * BLOCK:2 * (2 + 2 * BLOCK)] == ["eager"] * (2 + 2 * BLOCK)
    timed = clock.log[2 + BLOCK:2 + 2 * BLOCK] + clock.log[2 * (2 + BLOCK) + BLOCK:]
    assert len(timed) == 2 * 60
    # Interleaved block by block (alternating which goes first), not one after the other: the settled
    # blocks are the first pair (stage's, then eager's), the next pair starts with eager.
    runs = [name for i, name in enumerate(timed) if i % BLOCK == 0]
    assert runs[:6] == ["stage", "eager", "eager", "stage", "stage", "eager"]


def test_spiky_timings_are_flagged_with_the_reason():
    clock = FakeClock()
    lat = measure(clock.model("stage", with_spikes(4.0, every=3, factor=6)), FEEDS, 0, 60, 1, "cpu",
                  adaptive=False, clock=clock)
    assert lat.unreliable and "p90/p50" in lat.unreliable


def test_a_busy_baseline_marks_the_stage_figure_unreliable():
    clock = FakeClock()
    # Eager's blocks drift: the machine got busy halfway through.
    eager = iter([10.0] * 40 + [40.0] * 30)  # 10 warm-up runs, then 30 at 10 ms and 30 at 40 ms
    lat = measure(clock.model("stage", steady(4.0)), FEEDS, 0, 60, 1, "cpu",
                  baseline=clock.model("eager", eager), adaptive=False, clock=clock)
    assert lat.unreliable and "eager beside it" in lat.unreliable and "spread" in lat.unreliable


def test_adaptive_timing_stops_early_on_a_steady_machine_but_not_on_a_noisy_one():
    clock = FakeClock()
    quiet = measure(clock.model("stage", steady(4.0)), FEEDS, 0, 200, 1, "cpu", clock=clock)
    assert quiet.iterations == MIN_ITERATIONS
    rng = np.random.default_rng(3)
    noisy_times = iter(rng.lognormal(np.log(4.0), 0.6, size=400))
    noisy = measure(clock.model("stage", noisy_times), FEEDS, 0, 200, 1, "cpu", clock=clock)
    assert noisy.iterations > 3 * MIN_ITERATIONS


def test_a_noisy_figure_stops_at_its_time_budget_and_says_how_wide_its_median_is():
    clock = FakeClock()
    rng = np.random.default_rng(3)
    # 200 ms calls spread as a cloud VM's: 15 calls are 3 s, the budget; the interval is still wide there.
    slow = measure(clock.model("stage", iter(rng.lognormal(np.log(200.0), 0.6, size=400))), FEEDS, 0, 50, 1, "cpu",
                   clock=clock, budget_s=3.0)
    assert slow.stopped == "budget" and slow.iterations == MIN_ITERATIONS
    assert slow.interval is not None and slow.interval > CI_TARGET
    # The same spread at 4 ms a call: the budget is never reached, the cap is.
    fast = measure(clock.model("stage", iter(rng.lognormal(np.log(4.0), 0.6, size=400))), FEEDS, 0, 50, 1, "cpu",
                   clock=clock, budget_s=3.0)
    assert fast.stopped == "iterations" and fast.iterations == 50
    # Steady: the interval stops it first, budget or not; eager beside it counts towards the budget too.
    quiet = measure(clock.model("stage", steady(300.0)), FEEDS, 0, 50, 1, "cpu", clock=clock, budget_s=3.0,
                    baseline=clock.model("eager", steady(300.0, seed=1)))
    assert quiet.stopped == "interval" and quiet.interval <= CI_TARGET and quiet.iterations == MIN_ITERATIONS
    fixed = measure(clock.model("stage", steady(300.0)), FEEDS, 0, 20, 1, "cpu", clock=clock, budget_s=0.1, adaptive=False)
    assert fixed.stopped is None and fixed.iterations == 20  # not adaptive: iterations is the count, no budget


def test_median_interval_is_half_the_order_statistics_interval():
    assert median_interval(np.full(20, 5.0)) == 0.0
    assert median_interval(np.full(5, 5.0)) is None  # too few runs to bound the median
    wide = median_interval(np.linspace(1, 10, 21))
    assert 0.2 < wide < 0.6 and not median_is_tight(np.linspace(1, 10, 21))


def test_warm_up_runs_until_the_runs_stop_getting_faster():
    clock = FakeClock()
    # Caches and thread pools warming: each block of calls faster than the one before, for five blocks.
    warming = [ms for ms in (60.0, 30.0, 10.0, 3.0, 1.0) for _ in range(BLOCK)]
    lat = measure(clock.model("eager", iter([60.0] * 2 + warming + [0.05] * 500)), FEEDS, 2, 30, 1, "cpu", adaptive=False, clock=clock)
    assert lat.p50_ms == pytest_approx(0.05, 0.01) and lat.unreliable is None


def test_median_interval_and_busy_reason_directly():
    assert median_is_tight(np.full(20, 5.0))
    assert not median_is_tight(np.linspace(1, 10, 20))
    assert not median_is_tight(np.full(3, 5.0))  # too few runs to bound the median
    assert busy_reason(np.full(30, 5.0), [5.0, 5.0, 5.0]) is None
    assert "spread" in busy_reason(np.full(30, 5.0), [5.0, 5.0, 9.0])


def test_old_results_without_the_new_fields_still_load():
    lat = Latency.model_validate({"batch_size": 1, "shape": {}, "p50_ms": 1, "p90_ms": 1, "p99_ms": 1, "mean_ms": 1,
                                  "throughput": 1, "iterations": 1, "provider": "cpu"})
    assert lat.unreliable is None and lat.speedup_vs_eager is None


def pytest_approx(value, rel):
    import pytest

    return pytest.approx(value, rel=rel)


def test_report_speedup_uses_the_eager_figure_timed_beside_the_stage_and_marks_busy_ones():
    from optpipe.reporting.run_report import stage_table
    from optpipe.core.results import RunReport, StageResult

    def lat(p50, eager=None, busy=None):
        return [Latency(batch_size=1, shape={"x": [1]}, p50_ms=p50, p90_ms=p50, p99_ms=p50, mean_ms=p50, throughput=1 / p50,
                        iterations=15, provider="cpu", eager_p50_ms=eager, unreliable=busy, load_average=7.5)]

    stages = [
        # Eager alone, timed while the machine was busy: 84 ms. Beside each stage it took 10-12 ms.
        StageResult(name="pytorch-eager", pass_name="eager", status="ok", latency=lat(84.0, busy="machine busy: p90/p50 3.0 > 1.5")),
        StageResult(name="export", pass_name="export", status="ok", latency=lat(5.0, eager=10.0)),
        StageResult(name="int8", pass_name="int8", parent="export", status="ok",
                    latency=lat(2.0, eager=12.0, busy="machine busy: run-to-run spread 80% > 50%")),
    ]
    report = RunReport(optpipe_version="dev", recipe="t", created="now", machine={}, evaluation={"batch_sizes": [1]},
                       reference="export", baseline="pytorch-eager", stages=stages)
    table = stage_table(report)
    head = next(line for line in table.splitlines() if line.startswith("| stage"))
    column = [c.strip() for c in head.split("|")].index
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.split("|")] for line in table.splitlines() if line.startswith("| "))}
    assert rows["export"][column("vs eager")] == "2.00x"  # 10 / 5, not 84 / 5
    assert rows["int8"][column("vs eager")] == "6.00x ⚠busy" and rows["int8"][column("vs parent")] == "2.50x ⚠busy"
    assert "p50 10.00 to 12.00 ms" in table and "int8: 1 of 1 latency figures unreliable" in table and "load average 7.5" in table


def test_report_names_the_figures_that_stopped_at_the_time_budget_with_their_interval():
    from optpipe.reporting.run_report import stage_table
    from optpipe.core.results import RunReport, StageResult

    def lat(batch, stopped, interval):
        return Latency(batch_size=batch, shape={"x": [batch]}, p50_ms=9.0, p90_ms=9.5, p99_ms=10.0, mean_ms=9.2, throughput=1.0,
                       iterations=15, provider="cpu", stopped=stopped, interval=interval)

    stages = [StageResult(name="fuse", pass_name="fuse", status="ok", latency=[lat(1, "interval", 0.02), lat(8, "budget", 0.071)]),
              StageResult(name="int8", pass_name="int8", parent="fuse", status="ok", latency=[lat(1, "iterations", 0.04)])]
    report = RunReport(optpipe_version="dev", recipe="t", created="now", machine={}, evaluation={"batch_sizes": [1, 8]},
                       reference="fuse", stages=stages)
    table = stage_table(report)
    assert "fuse: 1 of 2 latency figures stopped at the time budget" in table and "±7% after 15 calls (batch 8)" in table
    assert "int8:" not in table.split("Latency at batch")[-1]  # a figure that ran to the cap is not the budget's




def test_warm_up_is_bounded_by_time_for_slow_calls_and_by_count_for_fast_ones():
    from optpipe.evaluation.latency import WARMUP_S, warm_up

    clock = FakeClock()
    warm_up(clock.model("slow", steady(300.0)), FEEDS, 10, clock)
    slow_calls = len(clock.log)
    # 0.5 s of untimed calls (2 of 300 ms, not 10), then two settling blocks of 2 calls.
    assert slow_calls == int(WARMUP_S / 0.3) + 1 + 2 * 2
    clock = FakeClock()
    warm_up(clock.model("fast", steady(1.0)), FEEDS, 10, clock)
    assert len(clock.log) == 10 + 2 * BLOCK  # fast calls: the full count and full blocks


def test_the_block_that_settles_warm_up_is_the_first_timed_block():
    clock = FakeClock()
    # 3 untimed runs; a block at 5 ms; one at 4 ms (20% faster: still warming); one no faster than that,
    # which settles the warm-up and is the figure: nothing more is timed for a 5-run figure.
    settling = [5.0] * BLOCK + [4.0] * BLOCK + [4.0] * (BLOCK - 1) + [4.4]
    lat = measure(clock.model("stage", iter([9.0] * 3 + settling + [1.0] * 100)), FEEDS, 3, BLOCK, 1, "cpu",
                  adaptive=False, clock=clock)
    assert len(clock.log) == 3 + 3 * BLOCK
    assert lat.iterations == BLOCK and lat.p50_ms == pytest_approx(4.0, 1e-9) and lat.p90_ms == pytest_approx(4.24, 0.01)


def test_a_warm_up_that_never_settles_is_not_timed():
    from optpipe.evaluation.latency import WARM_CAP_S, warm_up

    # Each call 7% faster than the one before: every block is over 10% faster than the previous one.
    warming = [400.0 * 0.93 ** i for i in range(60)]
    assert sum(warming) / 1e3 > WARM_CAP_S
    clock = FakeClock()
    assert warm_up(clock.model("stage", iter(warming)), FEEDS, 0, clock) is None
    clock, taken = FakeClock(), []
    durations = iter(warming + [1.0] * 100)
    lat = measure(clock.model("stage", (taken.append(ms) or ms for ms in durations)), FEEDS, 0, 10, 1, "cpu",
                  adaptive=False, clock=clock)
    # The figure is the 10 runs after warm-up, none of the blocks that were still getting faster.
    assert lat.iterations == 10 and lat.p50_ms == pytest_approx(float(np.median(taken[-10:])), 1e-9)
    assert lat.p50_ms < float(np.median(taken[-15:-10]))


def test_a_runnable_warmed_on_the_same_shapes_makes_no_untimed_calls():
    warmth, clock = Warmth(), FakeClock()
    eager = clock.model("eager", steady(10.0, seed=1))
    stages = [clock.model(f"stage{i}", steady(4.0, seed=i + 2)) for i in range(2)]
    first = measure(stages[0], FEEDS, 4, 30, 1, "cpu", baseline=eager, adaptive=False, clock=clock, warmth=warmth)
    assert clock.log.count("eager") == 4 + 2 * BLOCK + 30 - BLOCK  # warmed from scratch the first time
    clock.log.clear()
    second = measure(stages[1], FEEDS, 4, 30, 1, "cpu", baseline=eager, adaptive=False, clock=clock, warmth=warmth)
    # Its first block agrees with the median it settled at: settled, and timed. The new stage is warmed in full.
    assert clock.log.count("eager") == 30 and clock.log.count("stage1") == 4 + 2 * BLOCK + 30 - BLOCK
    assert second.eager_p50_ms == pytest_approx(first.eager_p50_ms, 0.01) and second.unreliable is None


def test_a_warmed_runnable_that_comes_back_slower_settles_again_and_a_busy_machine_is_still_flagged():
    warmth, clock = Warmth(), FakeClock()
    durations = iter([10.0] * (2 + 2 * BLOCK + 25))  # warmed and timed at 10 ms
    # Back after a pause: a cold first block (25 ms), then a busy machine: 14-40 ms, spiky.
    durations = iter([*durations, *([25.0] * BLOCK), *(14.0 if i % 3 else 40.0 for i in range(200))])
    eager = clock.model("eager", durations)
    measure(clock.model("stage0", steady(4.0)), FEEDS, 2, 30, 1, "cpu", baseline=eager, adaptive=False, clock=clock, warmth=warmth)
    clock.log.clear()
    lat = measure(clock.model("stage1", steady(4.0)), FEEDS, 2, 30, 1, "cpu", baseline=eager, adaptive=False, clock=clock, warmth=warmth)
    # No untimed calls; the cold block (2.5x its last median) did not count as settled, nor the next (a
    # median of 14 ms is faster than 25 ms: still warming, by the rule), the third settled it and is timed.
    assert clock.log.count("eager") == 3 * BLOCK + 30 - BLOCK
    assert lat.eager_p50_ms == pytest_approx(14.0, 0.01)
    assert lat.unreliable and "eager beside it" in lat.unreliable


def test_a_runnable_warmed_on_other_shapes_makes_one_untimed_call_on_a_new_shape():
    from optpipe.evaluation.latency import NEW_SHAPE_CALLS

    warmth, clock = Warmth(), FakeClock()
    run = clock.model("session", steady(4.0))
    measure(run, FEEDS, 10, 15, 1, "cpu", adaptive=False, clock=clock, warmth=warmth)
    assert len(clock.log) == 10 + 2 * BLOCK + 15 - BLOCK
    clock.log.clear()
    measure(run, {"x": np.zeros((4, 3), dtype=np.float32)}, 10, 15, 1, "cpu", adaptive=False, clock=clock, warmth=warmth)
    assert len(clock.log) == NEW_SHAPE_CALLS + 2 * BLOCK + 15 - BLOCK
    clock.log.clear()
    other = clock.model("other session", steady(4.0))  # another runnable: nothing of the first's warmth
    measure(other, FEEDS, 10, 15, 1, "cpu", adaptive=False, clock=clock, warmth=warmth)
    assert len(clock.log) == 10 + 2 * BLOCK + 15 - BLOCK


def test_adaptive_timing_can_stop_at_min_iterations_after_a_short_settled_block():
    from optpipe.evaluation.latency import WARM_BLOCK_S

    clock = FakeClock()
    call_ms = 1e3 * WARM_BLOCK_S / 3.5  # settling blocks of 3 runs
    lat = measure(clock.model("batch 8", steady(call_ms)), FEEDS, 1, 50, 1, "cpu", clock=clock)
    assert lat.iterations == MIN_ITERATIONS
    assert len(clock.log) == 1 + 3 + MIN_ITERATIONS  # one untimed call, a first settling block, then the figure: 3 + 5 + 5 + 2


def test_a_steady_slowdown_from_other_processes_is_flagged_from_their_cpu_time():
    """Two processes spinning on this machine's cores: the timings stay steady (no tail, no
    spread), but the kernel's count of the CPU time they took flags the figure."""
    import subprocess

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(os.sched_getaffinity(0)))]  # one per core it may use
    try:
        time.sleep(0.2)

        def run(feeds):
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            return {}

        lat = measure(run, FEEDS, 2, 400, 1, "cpu", adaptive=False)  # ~1 s: long enough to count
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if lat.others_cpu is None:
        pytest.skip("no /proc/stat here: only the timing's shape can judge")
    assert lat.others_cpu > 0.4 and "other processes took" in lat.unreliable, lat


def test_other_processes_share_is_the_busy_time_they_added_over_the_cpus_offered():
    from optpipe.evaluation.cpu_contention import CpuSnapshot, others_share

    start = CpuSnapshot(wall_s=100.0, busy_s=50.0, own_s=10.0, cpus=2)
    # 2 s on 2 CPUs = 4 CPU-seconds offered; 3 busy, 2 of them ours: others took 1 = 25%.
    assert others_share(start, CpuSnapshot(wall_s=102.0, busy_s=53.0, own_s=12.0, cpus=2)) == 0.25
    assert others_share(start, CpuSnapshot(wall_s=100.2, busy_s=53.0, own_s=10.0, cpus=2)) is None  # too short
    assert others_share(None, start) is None
    assert busy_reason(np.full(30, 5.0), [5.0, 5.0, 5.0], others_cpu=0.1) is None
    assert "other processes took 60%" in busy_reason(np.full(30, 5.0), [5.0, 5.0, 5.0], others_cpu=0.6)
