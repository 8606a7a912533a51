"""Real compiles (subprocesses) killed at chosen points, and compiles running at once on one cache.

The recipe imports a tiny ONNX model, then runs the test pass `gate` (it waits for a release
file: a deterministic point inside a pass) and `simplify`. After each kill the cache must hold
no corrupt entry, and the rerun must finish with the same stage hashes and accuracy as a
clean run. Speed is never asserted.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_fixtures import onnx_recipe, plugin_env, write_linear_onnx, write_recipe

STAGES = {
    "export": {"pass": "export"},
    "gate": {"pass": "gate", "after": "export"},
    "simplify": {"pass": "simplify", "after": "gate"},
}
# Enough timed iterations that evaluation lasts long enough to be interrupted.
EVALUATE = {"warmup": 1, "iterations": 20000, "batch_sizes": [1, 8], "eager_baseline": False}
WAIT_S = 120


def make_project(folder: Path, stages: dict = STAGES, **extra) -> Path:
    write_linear_onnx(folder / "model")
    (folder / "gate").mkdir(parents=True, exist_ok=True)
    recipe = onnx_recipe(folder, stages=stages, evaluate=EVALUATE, **extra)
    return write_recipe(folder, recipe)


def start(folder: Path, recipe: Path, *args: str, cache: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "optpipe.cli", "compile", str(recipe), *args]
    if cache is not None:
        cmd += ["--cache-dir", str(cache)]
    return subprocess.Popen(cmd, cwd=folder, env=plugin_env(folder / "gate"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, out, err


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def release_gate(folder: Path) -> None:
    (folder / "gate" / "release").touch()


def summary(run_dir: Path) -> dict:
    """What must not depend on how the run got there: per stage, status, model hash and accuracy."""
    report = json.loads((run_dir / "report.json").read_text())
    return {
        s["name"]: (s["status"], s["hash"], [(o["name"], o["max_abs"], o["cosine_mean"]) for o in s["accuracy"]["outputs"]])
        for s in report["stages"]
    }


def cache_verifies(folder: Path, cache: Path, runs: tuple[str, ...] = ("run",)) -> None:
    run_args = [arg for run in runs if (folder / run).exists() for arg in ("--run", str(folder / run))]
    proc = subprocess.run([sys.executable, "-m", "optpipe.cli", "cache", "--cache-dir", str(cache), "verify", *run_args],
                          cwd=folder, capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 0 and "0 corrupted" in proc.stdout, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("clean")
    recipe = make_project(folder)
    release_gate(folder)
    code, out, err = finish(start(folder, recipe))
    assert code == 0, err
    return summary(folder / "run")


def during_gate(folder: Path) -> None:
    wait_for(lambda: (folder / "gate" / "gate.started").exists(), "the gate pass to start")


def during_evaluation(folder: Path) -> None:
    release_gate(folder)
    # The results folder also keeps preflight's and coverage's memos: wait for an evaluation's figures.
    wait_for(lambda: any('"latency"' in _text(p) for p in (folder / "cache" / "results").glob("*.json")),
             "the first evaluation to finish")


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # renamed or removed between glob and read
        return ""


@pytest.mark.parametrize(
    "point, sig",
    [
        (during_gate, signal.SIGINT),
        (during_gate, signal.SIGKILL),
        (during_gate, signal.SIGTERM),
        (during_evaluation, signal.SIGINT),
        (during_evaluation, signal.SIGKILL),
    ],
    ids=["pass-SIGINT", "pass-SIGKILL", "pass-SIGTERM", "evaluation-SIGINT", "evaluation-SIGKILL"],
)
def test_a_killed_compile_resumes_to_the_same_results(point, sig, tmp_path, clean_run):
    recipe = make_project(tmp_path)
    proc = start(tmp_path, recipe)
    point(tmp_path)
    proc.send_signal(sig)
    code, out, err = finish(proc)

    assert "Traceback" not in err, err
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:
        assert code == (130 if sig == signal.SIGINT else 143), err
        last = err.strip().splitlines()[-1]
        assert last.startswith("interrupted") and "rerun the same command to resume" in last, err
        if point is during_gate:
            assert "during stage 'gate'" in last and "1 finished stage (export)" in last, last
        else:
            assert "during evaluat" in last and "3 finished stages" in last, last
        # Ctrl-C unwinds: the workdir of the interrupted stage is removed on the way out.
        assert not list((tmp_path / "cache" / "tmp").glob("work-*")), "an interrupted run leaves no workdir"
    cache_verifies(tmp_path, tmp_path / "cache")

    release_gate(tmp_path)
    code, out, err = finish(start(tmp_path, recipe))
    assert code == 0, err
    assert summary(tmp_path / "run") == clean_run
    assert "cache hit" in (tmp_path / "run" / "logs" / "export.log").read_text(), "finished stages are reused"
    assert not list((tmp_path / "cache" / "tmp").glob("work-*")), "the rerun swept the killed run's workdir"
    cache_verifies(tmp_path, tmp_path / "cache")


def test_two_compiles_at_once_share_one_cache(tmp_path, clean_run):
    """Two runs of one recipe and a third recipe sharing its first stages, all at once on one cache:
    every shared stage is computed once (the others wait on its lock, then reuse it), all finish."""
    recipe = make_project(tmp_path)
    other_stages = {**STAGES, "simplify": {"pass": "simplify", "after": "gate", "params": {"backend": "onnxsim"}}}
    other = write_recipe(tmp_path, onnx_recipe(tmp_path, stages=other_stages, evaluate=EVALUATE, name="other"), "other.yaml")
    procs = {
        "a": start(tmp_path, recipe, "--output", "run-a"),
        "b": start(tmp_path, recipe, "--output", "run-b"),
        "c": start(tmp_path, other, "--output", "run-c"),
    }
    during_gate(tmp_path)
    time.sleep(1.5)  # the other two reach the gate stage and wait on its lock meanwhile
    runs = (tmp_path / "gate" / "gate.runs").read_text().split()
    assert len(runs) == 1, "one process computes the gate stage at a time"
    release_gate(tmp_path)
    for name, proc in procs.items():
        code, out, err = finish(proc)
        assert code == 0, (name, err)
        assert "Traceback" not in err
    assert len((tmp_path / "gate" / "gate.runs").read_text().split()) == 1, "the gate stage was computed once, then reused"

    reports = {name: json.loads((tmp_path / f"run-{name}" / "report.json").read_text()) for name in procs}
    for stage in ("export", "gate"):
        rows = [next(s for s in r["stages"] if s["name"] == stage) for r in reports.values()]
        assert len({row["hash"] for row in rows}) == 1
        computed = [name for name in procs if "running pass" in (tmp_path / f"run-{name}" / "logs" / f"{stage}.log").read_text()]
        assert len(computed) == 1, f"{stage} computed by exactly one process, not {computed}"
    assert summary(tmp_path / "run-a") == summary(tmp_path / "run-b") == clean_run
    cache_verifies(tmp_path, tmp_path / "cache", ("run-a", "run-b", "run-c"))
