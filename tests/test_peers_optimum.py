"""bench/peers.py's Optimum recipe: its own commands in order, with ORT's shape pre-processing before quantize."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Fake tools: each appends its arguments to calls.log and writes what the real one writes.
OPTIMUM_CLI = """#!/bin/sh
echo "optimum-cli $*" >> "$CALLS"
case "$1" in
  export) mkdir -p "$7" && touch "$7/model.onnx" ;;
  onnxruntime) last=$(eval echo \\${$#}); mkdir -p "$last"; case "$2" in
      optimize) touch "$last/model_optimized.onnx" "$last/config.json" ;;
      quantize) touch "$last/model_optimized_quantized.onnx" ;; esac ;;
esac
"""
PYTHON = """#!/bin/sh
echo "python $*" >> "$CALLS"
touch "$6"
"""


def test_optimum_runs_export_optimize_preprocess_quantize_in_order(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import peers

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("optimum-cli", OPTIMUM_CLI), ("python", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("PEERS_BIN", str(bin_dir))
    monkeypatch.setenv("CALLS", str(calls))
    out = tmp_path / "optimum"
    result = peers._optimum(tmp_path / "hf", out)
    assert result == out / "quantized" / "model_optimized_quantized.onnx"
    lines = calls.read_text().splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["optimum-cli", "export", "onnx"], ["optimum-cli", "onnxruntime", "optimize"],
        ["python", "-m", "onnxruntime.quantization.preprocess"], ["optimum-cli", "onnxruntime", "quantize"]]
    assert "-O2" in lines[1] and "--avx512_vnni --per_channel" in lines[3]
    # Shapes only (Optimum's graph unchanged), into a copy of the -O2 folder that quantize then reads.
    assert "--skip_optimization True" in lines[2] and f"--output {out / 'O2-shapes' / 'model_optimized.onnx'}" in lines[2]
    assert f"--onnx_model {out / 'O2-shapes'}" in lines[3] and (out / "O2-shapes" / "config.json").is_file()
    assert peers._optimum(tmp_path / "hf", out) == result and len(calls.read_text().splitlines()) == 4  # reused


def test_peers_run_with_the_hub_off(tmp_path, monkeypatch):
    """The peers read the local model folder only: their commands run with Hugging Face Hub access off."""
    sys.path.insert(0, str(ROOT / "bench"))
    import peers

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen = tmp_path / "env.txt"
    peers._run(["/bin/sh", "-c", f'echo "$HF_HUB_OFFLINE $TRANSFORMERS_OFFLINE" > {seen}'], tmp_path / "log.txt")
    assert seen.read_text().split() == ["1", "1"]
