#!/usr/bin/env bash
# Every GPU check in one go, on a fresh machine with an NVIDIA GPU (budget: under 8 minutes):
#   1. install optpipe with its dev extras (skip with SKIP_INSTALL=1; PIP_FIND_LINKS=dir for a wheelhouse)
#   2. the `gpu`-marked tests (TensorRT engines; they skip themselves where TensorRT's libraries are absent)
#   3. MiniLM and ResNet-50 GPU rows: ORT's CUDA EP (FP32, FP16, QDQ INT8) against PyTorch eager on CUDA,
#      TensorRT's EP only where its libraries load -> docs/benchmarks-gpu.md
#   4. a summary; the exit code is non-zero if any step failed.
# Usage: scripts/gpu_checks.sh [--dry-run]   (timeouts per step: install 150 s, tests 90 s, rows 220 s)
#   GPU_RECIPES="a.yaml b.yaml" and GPU_TESTS=path narrow the rows and the tests.
#   --dry-run: check every command without a GPU: bash syntax, the install spec, that pytest collects the
#   gpu tests, and that the benchmark's recipes, cut-down stage lists and imports are sound. Runs in seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
PYTHON="${PYTHON:-python}"
export OPTPIPE_CACHE="${OPTPIPE_CACHE:-$PWD/.optpipe-cache}"
log="$(mktemp -d)"
read -ra RECIPES <<<"${GPU_RECIPES:-recipes/minilm-all.yaml recipes/resnet50.yaml}"
GPU_TESTS="${GPU_TESTS:-tests/}"
declare -A rc

step() { echo "== $1"; }

step "machine"
"$PYTHON" - <<'PY'
import onnxruntime as ort
print("onnxruntime", ort.__version__, "providers:", ", ".join(ort.get_available_providers()))
try:
    import torch
    print("torch", torch.__version__, "cuda device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
except Exception as exc:
    print("torch: not importable:", exc)
try:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
except Exception as exc:
    print("tensorrt: not importable (TensorRT EP and engine tests skip):", type(exc).__name__)
PY

step "install"
if [ "$DRY_RUN" = 1 ]; then
  # The spec pip would install, resolved against what is already here: no download, nothing changed.
  "$PYTHON" -m pip install --disable-pip-version-check --dry-run --no-deps -e '.[dev]' >"$log/install.txt" 2>&1
  rc[install]=$?
elif [ "${SKIP_INSTALL:-0}" = 1 ]; then
  echo "skipped (SKIP_INSTALL=1)"; rc[install]=0
else
  timeout 150 "$PYTHON" -m pip install --disable-pip-version-check -q -e '.[dev]' >"$log/install.txt" 2>&1
  rc[install]=$?
fi
tail -n 2 "$log/install.txt" 2>/dev/null

step "gpu tests"
if [ "$DRY_RUN" = 1 ]; then
  "$PYTHON" -m pytest -m gpu -q --collect-only $GPU_TESTS >"$log/pytest.txt" 2>&1
else
  timeout 90 "$PYTHON" -m pytest -m gpu -q -rA $GPU_TESTS >"$log/pytest.txt" 2>&1
fi
rc[tests]=$?
[ "${rc[tests]}" = 5 ] && rc[tests]=0  # no gpu-marked test collected is not a failure
tail -n 3 "$log/pytest.txt"

step "GPU rows: ${RECIPES[*]}"
args=("${RECIPES[@]}")
[ "$DRY_RUN" = 1 ] && args+=(--dry-run)
timeout 220 "$PYTHON" bench/gpu_rows.py "${args[@]}" 2>&1 | tee "$log/gpu_rows.txt" | grep -v '^ \|^\[\|^{\|^}'
rc[rows]=${PIPESTATUS[0]}

step "summary"
failed=0
for name in install tests rows; do
  echo "$name: exit ${rc[$name]}"
  [ "${rc[$name]}" = 0 ] || failed=1
done
echo "logs: $log"
exit $failed
