"""`optpipe serve RUN` on a real Triton server (queried over HTTP and gRPC, stopped by Ctrl-C) and
`optpipe serve --bench` (rows in report.json, the plot in report.html), on the serving tests' tiny CNN run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from optpipe.serving.triton_server import free_port
from serving_fixtures import cnn_run, grpc_inputs, http_inputs, needs_triton, stage_outputs

pytestmark = needs_triton()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return cnn_run(tmp_path_factory)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if client.is_server_ready():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise AssertionError(f"optpipe serve not ready (exit {process.poll()}): {process.stderr.read() if process.poll() is not None else ''}")


def test_serve_answers_over_http_and_grpc_and_stops_on_ctrl_c(run):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    run_dir, report = run
    stage = report.pareto[0]
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "OPTPIPE_CACHE": str(run_dir.parent / "cache")}
    process = subprocess.Popen([sys.executable, "-m", "optpipe.cli", "serve", str(run_dir), "--stage", stage,
                                "--http-port", str(http_port), "--grpc-port", str(grpc_port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_ready(f"127.0.0.1:{http_port}", process)
        feeds = {"image": np.random.default_rng(3).standard_normal((5, 3, 16, 16)).astype(np.float32)}
        expected = stage_outputs(run_dir, stage, feeds)["logits"]
        name = f"tiny_{stage}"
        with httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as http:
            np.testing.assert_allclose(http.infer(name, http_inputs(feeds)).as_numpy("logits"), expected, rtol=1e-5, atol=1e-5)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc:
            assert grpc.is_model_ready(name)
            np.testing.assert_allclose(grpc.infer(name, grpc_inputs(feeds)).as_numpy("logits"), expected, rtol=1e-5, atol=1e-5)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130
    assert err.strip().splitlines()[-1].startswith("interrupted: the server stopped") and "Traceback" not in err
    assert f"http://127.0.0.1:{http_port}/v2/models/{name}" in out
    with pytest.raises(OSError):  # nothing listens any more: the server went with the command
        import socket

        socket.create_connection(("127.0.0.1", http_port), timeout=2).close()


def test_bench_writes_rows_and_the_plot(run, cli_run):
    run_dir, report = run
    result = cli_run("serve", str(run_dir), "--bench", "--concurrency", "1,4", "--duration", "0.5", cache=run_dir.parent / "cache")
    assert result.exit_code == 0, result.output
    serving = json.loads((run_dir / "report.json").read_text())["serving"]
    stages = set(report.pareto)
    points = serving["points"]
    assert {(p["stage"], p["dynamic_batching"], p["concurrency"]) for p in points} == {
        (s, b, c) for s in stages for b in (True, False) for c in (1, 4)}
    for p in points:
        assert p["requests"] > 0 and p["errors"] == 0 and p["throughput_rps"] > 0 and p["p99_ms"] >= p["p50_ms"] > 0
        if not p["dynamic_batching"]:
            assert p["requests_per_execution"] == 1.0  # without the batcher Triton executes requests one by one
    assert serving["cpu"]["cores"] == os.cpu_count() and "load_before" in serving["cpu"]
    html = (run_dir / "report.html").read_text()
    assert "Serving: throughput vs concurrency" in html and "id='plot-serving'" in html
    assert "## Serving: throughput vs concurrency" in (run_dir / "report.md").read_text()


def test_serve_refuses_a_stage_the_run_lacks_in_one_line(run, cli_run):
    run_dir, _ = run
    result = cli_run("serve", str(run_dir), "--stage", "nope", cache=run_dir.parent / "cache")
    assert result.exit_code == 2
    assert "stage 'nope' is not in this run" in result.output and "Traceback" not in result.output
