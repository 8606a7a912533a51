"""Latency: percentiles over timed iterations after warm-up, threads pinned.

Polygraphy logs only the mean of its timings; percentiles are computed here.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from optpipe.results import Latency
from optpipe.runtime import Feeds, Outputs, pinned_threads


def measure(
    run: Callable[[Feeds], Outputs],
    feeds: Feeds,
    warmup: int,
    iterations: int,
    threads: int,
    provider: str,
    progress: Callable[[int, int], None] | None = None,
) -> Latency:
    """`progress(done, total)` is told after warm-up and every timed iteration (outside the timed span)."""
    with pinned_threads(threads):
        for _ in range(warmup):
            run(feeds)
        times = np.empty(iterations)
        for i in range(iterations):
            if progress is not None:
                progress(i, iterations)
            start = time.perf_counter()
            run(feeds)
            times[i] = time.perf_counter() - start
        if progress is not None:
            progress(iterations, iterations)
    ms = times * 1e3
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
        iterations=iterations,
        provider=provider,
    )
