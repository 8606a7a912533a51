#!/usr/bin/env bash
# Run a command (default: README's test command) as if on an AVX2-only x86 CPU (issue 17's class: AVX2 + FMA, no
# AVX-512, no VNNI), on a machine that has more. For the numerics of that class, not its speed.
#
# Why emulation: ONEDNN_MAX_CPU_ISA holds only oneDNN (OpenVINO's CPU plugin) to AVX2. ONNX Runtime's MLAS, PyTorch
# and NumPy pick their kernels from CPUID, and no switch holds them down; MLAS's u8 x s8 kernels saturate without
# VNNI (docs/int8.md), which is what the suite must hold on AVX2. QEMU's user-mode emulator (TCG, 7.2 or newer has
# AVX2/FMA) answers CPUID as a Haswell: every library dispatches its AVX2 kernels. About 6x slower than native.
#
# Every Python process the command starts runs emulated too: the interpreter is a wrapper that starts QEMU, in a
# throwaway venv that shares the site-packages of the venv optpipe is installed in, so subprocess and multiprocessing children
# (sys.executable) get it. Native binaries a test starts itself (a Triton server) run natively: with CI unset the
# serving tests that need one skip. /proc/cpuinfo still lists the host's flags under QEMU, so optpipe's CPU
# detection is given the emulated CPU's (OPTPIPE_CPU_FEATURES=avx2,fma).
#
# Usage: scripts/avx2_emulated.sh [command ...]      e.g. scripts/avx2_emulated.sh python -m pytest -q tests/test_int8.py
#   Needs: qemu-user (Debian/Ubuntu: apt-get install qemu-user) and optpipe installed in the venv of `python` (README's
#   first command; or PYTHON=path/to/venv/bin/python).
# Seen with QEMU 7.2: one long-lived emulated pytest process (many ORT/OpenVINO thread pools) died of SIGSEGV in a test
# that passes alone, emulated too: README's test command gives the suite to pytest-xdist (pyproject's addopts), whose
# workers are restarted.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "error: $1" >&2; exit 2; }
command -v qemu-x86_64 >/dev/null || fail "qemu-x86_64 not found: install QEMU's user-mode emulator (apt-get install qemu-user)"
version=$(qemu-x86_64 --version | sed -n 's/^qemu-x86_64 version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
read -r major minor <<<"${version:-0 0}"
{ [ "$major" -gt 7 ] || { [ "$major" -eq 7 ] && [ "$minor" -ge 2 ]; }; } \
    || fail "qemu-x86_64 ${major}.${minor} has no AVX2 in its emulator: QEMU 7.2 or newer is needed"
[ "$(uname -m)" = "x86_64" ] || fail "this emulates an x86 CPU on an x86_64 machine; this one is $(uname -m)"
PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null || fail "$PYTHON not found: activate the venv optpipe is installed in (README's first command), or set PYTHON"
# The interpreter the venv was made from, its site-packages, its version: the emulated venv shares them.
read -r real site version < <("$PYTHON" -c 'import os, sys, sysconfig; v = "%d.%d" % sys.version_info[:2]; print(os.path.join(sys.base_prefix, "bin", "python" + v), sysconfig.get_paths()["purelib"], v)')
[ -x "$real" ] || fail "the base interpreter of $PYTHON ($real) is missing: recreate the venv"
(cd / && "$PYTHON" -c "import optpipe" 2>/dev/null) || fail "optpipe is not installed for $PYTHON: run README's first command (or set PYTHON)"
home=$(dirname "$real")
# Haswell: AVX2, FMA, F16C, no AVX-512. The flags TCG cannot provide are turned off, or QEMU warns on every start
# (and the suite's one-line-error checks read stderr).
CPU="Haswell,-invpcid,-rtm,-hle,-pcid,-x2apic,-tsc-deadline"

venv=$(mktemp -d "${TMPDIR:-/tmp}/optpipe-avx2.XXXXXX")
trap 'rm -rf "$venv"' EXIT
mkdir -p "$venv/bin" "$venv/lib/python$version"
ln -s "$site" "$venv/lib/python$version/site-packages"
printf 'home = %s\ninclude-system-site-packages = false\nversion = %s\n' "$home" "$version" >"$venv/pyvenv.cfg"
# -0 sets the emulated program's argv[0]: Python then takes the wrapper as sys.executable and finds the venv by it.
printf '#!/bin/sh\nexec qemu-x86_64 -cpu %s -0 %s %s "$@"\n' "$CPU" "$venv/bin/python" "$real" >"$venv/bin/python"
chmod +x "$venv/bin/python"
ln -s python "$venv/bin/python3"

export PATH="$venv/bin:$PATH" OPTPIPE_CPU_FEATURES="avx2,fma"
unset ONEDNN_MAX_CPU_ISA
capability=$("$venv/bin/python" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
[ "$capability" = "AVX2" ] || fail "the emulated CPU is not AVX2-only (PyTorch dispatches $capability)"
echo "emulated x86-avx2 (qemu-x86_64 -cpu Haswell; PyTorch dispatches $capability): ${*:-python -m pytest -q}" >&2
if [ "$#" -eq 0 ]; then set -- python -m pytest -q; fi
"$@"
