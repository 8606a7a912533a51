"""A concurrency sweep against a running server, as Triton's perf_analyzer measures one.

perf_analyzer itself is not in the pytriton wheel (it ships with Triton's SDK image), so the sweep
is written here on tritonclient's gRPC client: N client threads, each with its own connection,
each sending one batch-1 request after another (perf_analyzer's `--concurrency-range`), for a
fixed time with a request cap (bounded loops). Per point: completed requests per second, p50 and
p99 latency as the client saw it, and how many requests Triton merged per model execution (its
statistics extension: inference_count / execution_count).

Points are interleaved (every model at one concurrency before the next concurrency), so a load
change on the machine spreads over all models instead of landing on one. Each point is
busy-flagged like every other figure (evaluation/cpu_contention.py): the CPU other processes
took, less this process (the clients) and the server's own process tree.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from optpipe.core.errors import first_line
from optpipe.evaluation import cpu_contention
from optpipe.evaluation.latency import BUSY_OTHERS, BUSY_THROTTLED

CONCURRENCIES = (1, 2, 4, 8, 16)
DURATION_S = 2.0
MAX_REQUESTS_PER_CLIENT = 2000  # the bound on a point, whatever the server's speed
WARMUP_REQUESTS = 3
REQUEST_TIMEOUT_S = 60.0


@dataclass
class LoadPoint:
    stage: str
    model: str
    dynamic_batching: bool
    concurrency: int
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    requests_per_execution: Optional[float]  # > 1: the dynamic batcher merged requests
    others_cpu: Optional[float]
    busy: Optional[str]  # why this figure cannot be trusted, or None
    throttled: Optional[float] = None  # the container's CPU quota's held-back share (cpu_contention); None: no quota

    def row(self) -> dict:
        return asdict(self)


def request_inputs(feeds: dict[str, np.ndarray]):
    """tritonclient gRPC inputs for one request."""
    from tritonclient.grpc import InferInput
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in feeds.items():
        tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(np.ascontiguousarray(array))
        inputs.append(tensor)
    return inputs


def single_requests(samples: dict[str, np.ndarray], count: int = 16) -> list[dict[str, np.ndarray]]:
    """Batch-1 requests cycled from the evaluation samples (what a one-sample-per-request client sends)."""
    total = len(next(iter(samples.values())))
    return [{name: array[i % total: i % total + 1] for name, array in samples.items()} for i in range(count)]


def measure_point(url: str, model, requests: list[dict[str, np.ndarray]], concurrency: int, duration_s: float,
                  server_pid: Optional[int]) -> LoadPoint:
    import tritonclient.grpc as grpcclient

    clients = [grpcclient.InferenceServerClient(url) for _ in range(concurrency)]
    prepared = [request_inputs(feeds) for feeds in requests]
    for client in clients:  # connections opened and the model warm before the clock starts
        for inputs in prepared[:WARMUP_REQUESTS]:
            try:
                client.infer(model.name, inputs, client_timeout=REQUEST_TIMEOUT_S)
            except Exception as exc:  # tritonclient's InferenceServerException: the server's own words
                from optpipe.serving.triton_server import ServingError

                raise ServingError(f"model '{model.name}' refused the evaluation inputs: {first_line(exc)}") from None
    before_stats = _counts(clients[0], model.name)
    latencies: list[list[float]] = [[] for _ in clients]
    errors = [0] * concurrency
    start_gate = threading.Barrier(concurrency + 1)
    deadline = [0.0]

    def client_loop(index: int) -> None:
        client = clients[index]
        start_gate.wait()
        for n in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline[0]:
                break
            began = time.perf_counter()
            try:
                client.infer(model.name, prepared[(index + n) % len(prepared)], client_timeout=REQUEST_TIMEOUT_S)
            except Exception:  # counted, not raised: a failed request is a figure of the point
                errors[index] += 1
                continue
            latencies[index].append((time.perf_counter() - began) * 1e3)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    cpu_before, server_before = cpu_contention.snapshot(), process_tree_cpu_s(server_pid)
    began = time.monotonic()
    deadline[0] = began + duration_s
    start_gate.wait()
    for thread in threads:
        thread.join(duration_s + REQUEST_TIMEOUT_S)
    wall = time.monotonic() - began
    cpu_after, server_after = cpu_contention.snapshot(), process_tree_cpu_s(server_pid)
    after_stats = _counts(clients[0], model.name)
    for client in clients:
        client.close()
    done = np.array([ms for per_client in latencies for ms in per_client])
    others = _others_share(cpu_before, cpu_after, server_before, server_after)
    throttled = cpu_contention.throttled_share(cpu_before, cpu_after)
    merged = None
    if before_stats and after_stats and after_stats[1] > before_stats[1]:
        merged = round((after_stats[0] - before_stats[0]) / (after_stats[1] - before_stats[1]), 2)
    return LoadPoint(
        stage=model.stage, model=model.name, dynamic_batching=model.dynamic_batching, concurrency=concurrency,
        requests=int(done.size), errors=sum(errors), throughput_rps=round(done.size / wall, 1) if wall > 0 else 0.0,
        p50_ms=round(float(np.percentile(done, 50)), 3) if done.size else None,
        p99_ms=round(float(np.percentile(done, 99)), 3) if done.size else None,
        requests_per_execution=merged, others_cpu=others, busy=_busy(others, throttled), throttled=throttled,
    )


def _busy(others: Optional[float], throttled: Optional[float]) -> Optional[str]:
    reasons = []
    if others is not None and others > BUSY_OTHERS:
        reasons.append(f"other processes took {others:.0%} of the CPUs > {BUSY_OTHERS:.0%}")
    if throttled is not None and throttled > BUSY_THROTTLED:
        # The server in the same container shares its quota: its waits land in the requests' latencies.
        reasons.append(f"the container's CPU quota held it back {throttled:.0%} of the CPUs' time > {BUSY_THROTTLED:.0%}")
    return ", ".join(reasons) or None


def sweep(url: str, models: list, requests: list[dict[str, np.ndarray]], concurrencies=CONCURRENCIES,
          duration_s: float = DURATION_S, server_pid: Optional[int] = None, progress=None) -> list[LoadPoint]:
    """Every model at every concurrency, interleaved (all models at one concurrency, then the next)."""
    points = []
    for concurrency in concurrencies:
        for model in models:
            point = measure_point(url, model, requests, concurrency, duration_s, server_pid)
            points.append(point)
            if progress is not None:
                progress(point)
    return points


def _counts(client, model: str) -> Optional[tuple[int, int]]:
    """(inference_count, execution_count) of the model, from Triton's statistics extension."""
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    except Exception:  # a server without the extension: the merge is not reported, the rest is
        return None
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def _others_share(cpu_before, cpu_after, server_before, server_after) -> Optional[float]:
    """cpu_contention.others_share less the server's own CPU time: the server is this figure, not a neighbour."""
    share = cpu_contention.others_share(cpu_before, cpu_after)
    if share is None or server_before is None or server_after is None:
        return share
    span = (cpu_after.wall_s - cpu_before.wall_s) * cpu_after.cpus
    return round(max(0.0, share - (server_after - server_before) / span), 3)


def process_tree_cpu_s(pid: Optional[int]) -> Optional[float]:
    """User + system CPU seconds of `pid` and its descendants (Triton's python-backend stubs), from /proc."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    if pid not in times:
        return None
    tree, frontier = {pid}, [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(times[p] for p in tree)
