"""scripts/gpu_checks.sh stays correct without a GPU: its dry run checks every command it would run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"


def dry_run(**env) -> subprocess.CompletedProcess:
    environment = os.environ | {"PYTHON": sys.executable, "GPU_TESTS": "tests/test_targets_gpu.py"} | env
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=environment, timeout=600)


def test_dry_run_checks_install_tests_and_gpu_rows():
    done = dry_run()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Would install optpipe" in out  # pip resolved the install spec
    assert "tests collected" in out  # the gpu-marked tests are collected
    # Each recipe cut down to its GPU candidates: no com.microsoft fusion, no dynamic int8, no pruning.
    assert "minilm-all: stages export, simplify, int8-static, fp16;" in out
    assert "resnet50: stages export, simplify, fp16, int8;" in out
    assert "rows: exit 0" in out


def test_dry_run_fails_on_a_broken_command():
    done = dry_run(GPU_RECIPES="recipes/minilm-all.yaml recipes/no-such.yaml")
    assert done.returncode != 0 and "rows: exit 1" in done.stdout, done.stdout


def test_script_has_valid_bash_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
