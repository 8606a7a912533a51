"""The serving parts that need no server: params, the busy figure's arithmetic, the report view, the
command's refusals (one line, exit 2)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from optpipe.evaluation.cpu_contention import CpuSnapshot
from optpipe.reporting.serving_view import render_serving_html, render_serving_markdown
from optpipe.serving.loadtest import _others_share, process_tree_cpu_s, single_requests
from optpipe.targets.base import TritonParams


def test_python_backend_refuses_what_it_cannot_run():
    assert TritonParams(backend="python", platform="openvino").backend == "python"
    with pytest.raises(ValidationError, match="backend python runs ONNX Runtime or OpenVINO"):
        TritonParams(backend="python", platform="tensorrt", device="gpu")
    with pytest.raises(ValidationError, match="backend python runs on the CPU"):
        TritonParams(backend="python", device="gpu")


def test_process_tree_cpu_counts_the_children():
    # A parent that sleeps and a child that spins: the tree's CPU is the child's.
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess,sys; subprocess.run([sys.executable,'-c',{spin!r}])"])
    try:
        time.sleep(0.2)
        start = process_tree_cpu_s(parent.pid)
        parent.wait(30)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert start is not None and process_tree_cpu_s(parent.pid) is None  # gone: None, not a made-up figure
    assert process_tree_cpu_s(None) is None
    assert process_tree_cpu_s(os.getpid()) > 0


def test_the_servers_own_cpu_is_not_counted_as_a_neighbours():
    before, after = CpuSnapshot(0.0, 0.0, 0.0, 2), CpuSnapshot(1.0, 1.6, 0.2, 2)  # 1.4 CPU-s not ours in 2 CPU-s
    assert _others_share(before, after, None, None) == 0.7
    assert _others_share(before, after, 5.0, 6.2) == 0.1  # 1.2 of them were the server's
    assert _others_share(before, after, 5.0, 7.0) == 0.0


def test_a_load_point_in_a_container_says_when_its_quota_held_it_back():
    from optpipe.serving.loadtest import _busy

    assert _busy(0.1, None) is None and _busy(0.1, 0.01) is None
    assert _busy(None, 0.3) == "the container's CPU quota held it back 30% of the CPUs' time > 5%"
    assert _busy(0.4, 0.3).startswith("other processes took 40% of the CPUs > 25%, the container's CPU quota")


def test_single_requests_cycle_the_samples():
    import numpy as np

    samples = {"x": np.arange(6, dtype=np.float32).reshape(3, 2)}
    requests = single_requests(samples, count=5)
    assert [r["x"].shape for r in requests] == [(1, 2)] * 5
    assert [float(r["x"][0, 0]) for r in requests] == [0.0, 2.0, 4.0, 0.0, 2.0]


SERVING = {
    "format": 1, "server": "tritonserver 2.51", "protocol": "gRPC", "duration_s": 1.0,
    "cpu": {"processor": "x86_64", "cores": 2, "load_before": [1.0, 1, 1], "load_after": [1.5, 1, 1]},
    "points": [
        {"stage": "int8", "model": "m", "dynamic_batching": b, "concurrency": c, "requests": 100, "errors": 0,
         "throughput_rps": 100.0 * c * (2 if b else 1), "p50_ms": 1.0, "p99_ms": 2.0, "requests_per_execution": 2.0 if b else 1.0,
         "others_cpu": 0.4 if c == 4 else 0.0, "busy": "other processes took 40% of the CPUs > 25%" if c == 4 else None}
        for b in (True, False) for c in (1, 4)
    ],
}


def test_the_report_view_shows_every_point_and_its_busy_flag():
    markdown = "\n".join(render_serving_markdown(SERVING))
    assert markdown.count("| `int8` |") == 4 and "| 800.0 |" in markdown
    assert "⚠busy: 2 of 4 points" in markdown and "load average 1.0 before, 1.5 after" in markdown
    page = render_serving_html(SERVING)
    assert "id='plot-serving'" in page and page.count("<tr>") == 5 and "⚠ other processes took 40%" in page
    assert render_serving_html(None) == "" and render_serving_markdown(None) == []


def test_serve_refuses_a_folder_that_is_no_run_and_bad_client_counts(tmp_path, cli_run):
    result = cli_run("serve", str(tmp_path))
    assert result.exit_code == 2 and "is not an optpipe run folder (no report.json)" in result.output
    result = cli_run("serve", str(tmp_path), "--bench", "--concurrency", "0,4")
    assert result.exit_code == 2 and "each client count must be between 1 and 64" in result.output
    result = cli_run("serve", str(tmp_path), "--bench", "--concurrency", "1,x")
    assert result.exit_code == 2 and "is not a comma-separated list of client counts" in result.output


def test_a_missing_triton_is_named_with_its_install_line(tmp_path, monkeypatch):
    from optpipe.serving.run_server import started_server
    from optpipe.serving.triton_server import ServingError

    monkeypatch.setenv("OPTPIPE_TRITON_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(ServingError, match="pip install nvidia-pytriton==0.7.0"):
        started_server(tmp_path)


def test_a_port_in_use_is_named_before_anything_starts(tmp_path):
    import socket

    from optpipe.serving.triton_server import ServingError, TritonInstall, TritonServer

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        fake = TritonInstall(*(tmp_path for _ in range(6)))  # never reached: the port check comes first
        with pytest.raises(ServingError, match=f"the HTTP port 127.0.0.1:{taken} is in use .*--http-port"):
            TritonServer(tmp_path, fake, http_port=taken).start()
