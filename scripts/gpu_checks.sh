#!/usr/bin/env bash
# Every GPU check in one go, for a machine with an NVIDIA GPU and TensorRT: the `gpu`-marked tests
# (TensorRT engines built, measured, served by Triton configs) and the tiny deploy recipe, then a summary.
# Usage: scripts/gpu_checks.sh   (inside the project's virtual environment)
set -uo pipefail
cd "$(dirname "$0")/.."
export OPTPIPE_CACHE="${OPTPIPE_CACHE:-$PWD/.optpipe-cache}"
log="$(mktemp -d)"

echo "== machine"
python - <<'PY'
try:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
except Exception as exc:
    print("tensorrt: not importable:", exc)
import torch
print("cuda device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY

echo "== gpu tests"
python -m pytest -m gpu -q -rA tests/ 2>&1 | tee "$log/pytest.txt"
tests_rc=${PIPESTATUS[0]}

echo "== tiny deploy recipe"
optpipe compile recipes/tiny-deploy.yaml --output "$log/tiny-deploy" >"$log/compile.txt" 2>&1
compile_rc=$?
sed -n '/^## Targets/,$p' "$log/tiny-deploy/report.md" 2>/dev/null

echo "== summary"
echo "gpu tests: $(tail -n 1 "$log/pytest.txt") (exit $tests_rc)"
echo "tiny deploy compile: exit $compile_rc (log: $log/compile.txt)"
[ "$tests_rc" -eq 0 ] && [ "$compile_rc" -eq 0 ]
