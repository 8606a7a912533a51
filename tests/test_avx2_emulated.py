"""scripts/avx2_emulated.sh: commands run as on an AVX2-only CPU under QEMU's user-mode emulator, or one line why not."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "avx2_emulated.sh"


def run(*command: str, path_first: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHON": sys.executable}
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *command], capture_output=True, text=True, env=env, timeout=600)


def test_script_has_valid_bash_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_a_qemu_without_avx2_is_refused_in_one_line(tmp_path):
    """QEMU's TCG emulates AVX2 from 7.2: an older one would run the command on a CPU without it."""
    fake = tmp_path / "qemu-x86_64"
    fake.write_text("#!/bin/sh\necho 'qemu-x86_64 version 6.2.0 (Debian 1:6.2+dfsg-2ubuntu6)'\n")
    fake.chmod(0o755)
    done = run("true", path_first=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: qemu-x86_64 6.2 has no AVX2 in its emulator: QEMU 7.2 or newer is needed"


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="QEMU's user-mode emulator is not installed (apt-get install qemu-user)")
def test_python_and_its_children_run_on_an_avx2_cpu():
    """PyTorch dispatches AVX2 kernels in the emulated process and in a child started through sys.executable, and
    optpipe names the class x86-avx2: what a real AVX2 machine shows."""
    child = "import subprocess, sys; print(subprocess.run([sys.executable, '-c', 'import torch; print(torch.backends.cpu.get_cpu_capability())'], capture_output=True, text=True).stdout.strip())"
    probe = ("import torch; from optpipe.hardware.cpu_features import machine_target; "
             f"print(torch.backends.cpu.get_cpu_capability(), machine_target().cpu_class); {child}")
    done = run("python", "-c", probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AVX2", "x86-avx2", "AVX2"]
    assert "TCG doesn't support" not in done.stderr  # the flags QEMU cannot give are turned off: no warning per process
