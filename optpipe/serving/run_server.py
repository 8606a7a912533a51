"""`optpipe serve RUN`: a finished run's stages on a real Triton server; `--bench`: its load test.

Why Triton (pytriton's tritonserver, python backend) and not KServe's or MLServer's Python server:
it is the server optpipe's Triton target deploys to, so the config that is tried here (dims,
max_batch_size, dynamic batching) is the one that ships; its dynamic batcher and statistics
extension are what the load test compares and reads (docs/serving.md has the measured figures).
All three speak the Open Inference Protocol, so a client written against `optpipe serve`
works against a KServe or Seldon deployment unchanged.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

from optpipe.core.errors import RunInterrupted
from optpipe.serving import loadtest
from optpipe.serving.repository import ServedModel, write_serving_repository
from optpipe.serving.triton_server import LOOPBACK, ServingError, TritonServer, find_triton, missing_reason

#: report.json's `serving` format: bump when a row's meaning changes.
SERVING_FORMAT = 1


def chosen_stages(run_dir: Path, stages: tuple[str, ...]) -> list[str]:
    """The stages named, else the run's Pareto frontier (what the targets emit by default)."""
    from optpipe.core.results import RunReport
    from optpipe.targets import default_target_stages

    if not (run_dir / "report.json").is_file():
        raise ServingError(f"'{run_dir}' is not an optpipe run folder (no report.json); pass the folder `optpipe compile` wrote")
    chosen = list(stages) or default_target_stages(RunReport.load(run_dir))
    if not chosen:
        raise ServingError("the run has no stage on its Pareto frontier; name one with --stage")
    return chosen


def started_server(repository: Path, host: str = LOOPBACK, http_port: Optional[int] = None,
                   grpc_port: Optional[int] = None) -> TritonServer:
    install = find_triton()
    if install is None:
        raise ServingError(missing_reason())
    ports = {key: value for key, value in (("http_port", http_port), ("grpc_port", grpc_port)) if value is not None}
    return TritonServer(repository, install, host=host, log_path=repository.parent / "tritonserver.log", **ports).start()


def serve_run(run_dir: Path, stages: tuple[str, ...], host: str, http_port: Optional[int], grpc_port: Optional[int],
              echo: Callable[[str], None], until: Optional[Callable[[], bool]] = None) -> None:
    """Serve until Ctrl-C (or `until()`), then stop the server and say so (RunInterrupted: exit 130)."""
    repository, served = write_serving_repository(run_dir, chosen_stages(run_dir, stages))
    server = None
    try:
        server = started_server(repository, host, http_port, grpc_port)
        echo(f"serving {', '.join(m.name for m in served)} on tritonserver (python backend, {served[0].runtime})")
        echo(f"  HTTP  http://{server.http_url}/v2/models/{served[0].name}   gRPC {server.grpc_url}   (Open Inference Protocol)")
        echo("  Ctrl-C stops it")
        while server.process.poll() is None and not (until and until()):
            time.sleep(0.2)
        if server.process.poll() is not None:
            raise ServingError(f"tritonserver stopped by itself ({server.process.returncode}): {server.log_tail()}")
    except KeyboardInterrupt:
        raise RunInterrupted("interrupted: the server stopped; nothing outside the run's serving/ folder was written") from None
    finally:
        if server is not None:
            server.stop()


def bench_run(run_dir: Path, stages: tuple[str, ...], concurrencies: tuple[int, ...] = loadtest.CONCURRENCIES,
              duration_s: float = loadtest.DURATION_S, cache_dir: Optional[Path] = None,
              echo: Callable[[str], None] = lambda line: None) -> dict:
    """The load test of `stages` (default: the frontier), with and without dynamic batching; its rows go
    into report.json (`serving`) and its plot into report.html."""
    from optpipe.core.results import RunReport
    from optpipe.reporting.run_report import machine_description, write_report

    chosen = chosen_stages(run_dir, stages)
    repository, served = write_serving_repository(run_dir, chosen, without_batching=True)
    requests = loadtest.single_requests(evaluation_samples(run_dir, cache_dir))
    load_before = os.getloadavg()
    try:
        with started_server(repository) as server:
            points = loadtest.sweep(server.grpc_url, served, requests, concurrencies, duration_s, server.process.pid,
                                    progress=lambda p: echo(point_line(p)))
    except KeyboardInterrupt:
        raise RunInterrupted("interrupted: the load test stopped with its server; report.json is unchanged") from None
    serving = {
        "format": SERVING_FORMAT,
        "server": "tritonserver 2.51 (nvidia-pytriton 0.7.0), python backend",
        "protocol": "gRPC, Open Inference Protocol; one batch-1 request per client at a time",
        "duration_s": duration_s,
        "cpu": {"processor": machine_description()["processor"], "cores": os.cpu_count(),
                "load_before": [round(v, 2) for v in load_before], "load_after": [round(v, 2) for v in os.getloadavg()]},
        "models": [vars(m) for m in served],
        "points": [p.row() for p in points],
    }
    report = RunReport.load(run_dir)
    report.serving = serving
    write_report(report, run_dir)
    return serving


def evaluation_samples(run_dir: Path, cache_dir: Optional[Path] = None):
    """The run's evaluation inputs (the figures the report's accuracy was measured on)."""
    from optpipe.recipe.run_paths import RunPaths
    from optpipe.targets import load_recipe_snapshot, target_settings

    recipe = load_recipe_snapshot(run_dir)
    return target_settings(recipe, RunPaths.resolve(recipe, cache_dir=cache_dir).cache_dir).eval_set().arrays


def point_line(point: loadtest.LoadPoint) -> str:
    merged = f", {point.requests_per_execution} req/execution" if point.requests_per_execution else ""
    busy = f"  ⚠busy: {point.busy}" if point.busy else ""
    errors = f", {point.errors} errors" if point.errors else ""
    return (f"  {point.model:<32} c={point.concurrency:<3} {point.throughput_rps:>8.1f} req/s  p50 {point.p50_ms} ms  "
            f"p99 {point.p99_ms} ms{merged}{errors}{busy}")


__all__ = ["ServedModel", "bench_run", "serve_run", "chosen_stages", "evaluation_samples"]
