"""The benchmark runner, generic over a recipe: every finished stage beside plain ONNX Runtime, written as Markdown."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from inspect_models import mlp_model, mlp_recipe, save

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_measures_every_stage_and_writes_markdown(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTPIPE_CACHE", str(tmp_path / "cache"))
    model_path = save(mlp_model(), tmp_path / "mlp.onnx")
    recipe = mlp_recipe(model_path, tmp_path / "run", sweep={})
    recipe_path = tmp_path / "tiny.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    bench = load_bench()
    args = SimpleNamespace(rounds=2, iterations=3, warmup=1, batch=None)
    result = bench.bench_recipe(recipe_path, args)
    names = [row["candidate"] for row in result["rows"]]
    # An ONNX source has no eager baseline; the peers take Hugging Face folders: one row says so.
    assert names == [bench.PLAIN_ORT, "optpipe:export", "optpipe:simplify", "peers"]
    assert "not run: they take Hugging Face model folders" in result["rows"][-1]["what"]
    timed = result["rows"][:3]
    assert all(row["p50_ms"] > 0 and row["p90_ms"] >= row["p50_ms"] for row in timed)
    assert all("busy" in row for row in timed) and "avx512_vnni" in result["isa"]
    assert result["samples_timed"] == 6 and result["shapes"] == {"x": [1, 4, 16]}
    text = bench.render_document([result, {"recipe": "recipes/absent.yaml", "error": "recipe 'recipes/absent.yaml' does not exist"}], "python bench/run.py x")
    assert "| optpipe:simplify" in text and "Machine:" in text and "`python bench/run.py x`" in text
    assert "not measured: recipe 'recipes/absent.yaml' does not exist" in text


def test_peers_run_their_own_commands_and_say_why_when_they_cannot(tmp_path, monkeypatch):
    """Fake peer CLIs: Olive writes a model (its path is used), Optimum fails (the row gives the log), none installed."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import peers

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "optimum-cli").write_text("#!/bin/sh\necho quantize broke >&2\nexit 3\n")
    # olive run --config FILE: writes output_dir/model.onnx as the real one does.
    (bin_dir / "olive").write_text("#!/bin/sh\nout=$(python3 -c \"import json,sys; print(json.load(open(sys.argv[1]))['output_dir'])\" \"$3\")\n"
                                   "mkdir -p \"$out\" && touch \"$out/model.onnx\"\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PEERS_BIN", str(bin_dir))
    model = tmp_path / "hf"
    assert peers._olive(model, tmp_path / "olive") == tmp_path / "olive" / "output" / "model.onnx"
    with pytest.raises(peers.PeerUnavailable, match=r"optimum-cli export onnx.*exit 3.*export\.log"):
        peers._optimum(model, tmp_path / "optimum")
    monkeypatch.setenv("PEERS_BIN", str(tmp_path / "empty"))
    with pytest.raises(peers.PeerUnavailable, match="`olive` not found"):
        peers._olive(model, tmp_path / "olive2")


@pytest.mark.parametrize("features, preset", [("avx2,fma", "avx2"), ("avx2,fma,avx512f", "avx512"),
                                              ("avx2,avx512f,avx512_vnni", "avx512_vnni"), ("arm64:asimd,asimddp", "arm64")])
def test_optimum_runs_its_preset_for_this_cpu(monkeypatch, features, preset):
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import peers

    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", features)
    assert peers.optimum_preset() == preset


def test_the_cpu_line_says_injected_features_change_choices_not_ort_kernels(monkeypatch):
    """Under OPTPIPE_CPU_FEATURES the tables' ORT and PyTorch speeds are still the CPU's own: the line says so."""
    from optpipe.hardware import cpu_features

    bench = load_bench()
    monkeypatch.setattr(cpu_features, "hardware_target", lambda: cpu_features.parse_features("avx2,fma,avx512f,avx512_vnni"))
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", "avx2,fma")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    line = bench.cpu_class_line()
    assert "optpipe's choices for x86-avx2" in line and "OpenVINO at x86-avx2 (ONEDNN_MAX_CPU_ISA=AVX2)" in line
    assert "ONNX Runtime and PyTorch kernels at the CPU's own class, x86-avx512-vnni" in line
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", "avx2,fma,avx512f,avx512_vnni")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert bench.cpu_class_line() == "x86-avx512-vnni (every engine)"
    assert bench.injected_note(line)[1].startswith("The CPU's features were injected") and bench.injected_note("x86-amx (every engine)") == []


def test_the_verdict_line_names_the_best_within_tolerance_of_each_side():
    bench = load_bench()
    rows = [{"candidate": "optpipe:ov-int8", "what": "openvino (OpenVINO, int8)", "speedup_vs_eager": 4.0, "cosine": 0.996, "within_tolerance": True},
            {"candidate": "optpipe:int8-qattention", "what": "int8 after fuse", "speedup_vs_eager": 2.8, "cosine": 0.991, "within_tolerance": True},
            {"candidate": "optpipe:int8-static", "what": "int8", "speedup_vs_eager": 5.0, "cosine": 0.9, "within_tolerance": False},
            {"candidate": "optimum:int8-avx2-per-channel", "what": "Optimum", "speedup_vs_eager": 2.9, "cosine": 0.991, "within_tolerance": True},
            {"candidate": "olive:int8-dynamic", "what": "Olive", "speedup_vs_eager": 3.5, "cosine": 0.95, "within_tolerance": False}]
    line = bench.verdict_lines(rows)[0]
    assert "optpipe `optpipe:ov-int8` 4.00x" in line and "ONNX Runtime only `optpipe:int8-qattention` 2.80x" in line
    assert "best peer `optimum:int8-avx2-per-channel` 2.90x" in line
    # Peer by peer at equal or better accuracy: ov-int8 beats Optimum; ORT alone (2.80x) is slower at 0.991.
    details = bench.verdict_lines(rows)[1:]
    assert details == ["- vs `optimum:int8-avx2-per-channel` (2.90x at 0.9910), optpipe: `optpipe:ov-int8` 4.00x at cosine 0.9960: "
                       "faster (1.38x its speed)",
                       "- vs `optimum:int8-avx2-per-channel` (2.90x at 0.9910), ONNX Runtime only: `optpipe:int8-qattention` 2.80x at "
                       "cosine 0.9910: level (0.97x its speed, within the 5% noise)"]


@pytest.mark.parametrize("ratio, said", [(1.06, "faster"), (1.01, "level"), (0.99, "level"), (0.951, "level"), (0.94, "**slower**")])
def test_a_speed_gap_inside_the_noise_is_called_level(ratio, said):
    # The same NNCF IR, as optpipe's ov-int8 and as the plain-NNCF peer, came out 1.2% apart in one run.
    assert load_bench().speed_verdict(ratio).startswith(said)


def test_the_gpu_document_is_written_and_timed_by_the_cpu_benchmark_s_functions():
    """bench/gpu_rows.py runs no table writer or timing loop of its own: a GPU-less render shows its table."""
    spec = importlib.util.spec_from_file_location("bench_gpu_rows", ROOT / "bench" / "gpu_rows.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    bench = load_bench()
    assert gpu.interleaved_timings.__module__ == gpu.markdown_table.__module__ == "run"
    result = {"model": "tiny", "device": "H200", "shapes": {"x": [1, 16]}, "compile_s": 1.0, "rows": [
        {"candidate": "eager", "p50_ms": 2.0, "p90_ms": 2.5, "speedup_vs_eager": 1.0, "cosine": None},
        {"candidate": "optpipe:fp16 [Tensorrt]", "error": "RuntimeError: no plugin"}]}
    lines = gpu.render([result], "python bench/gpu_rows.py x").splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[:2] == bench.markdown_table(["candidate", "p50 ms", "p90 ms", "vs eager CUDA", "cosine", "providers kept"], [])
    assert table[2] == "| eager | 2.000 | 2.500 | 1.00x |  |  |"
    assert table[3] == "| optpipe:fp16 [Tensorrt] | not run: RuntimeError: no plugin |  |  |  |  |"
    # Timing: every candidate warmed up, then the same count of timed runs each, in rotated order.
    calls = []
    times = gpu.interleaved_timings({"a": lambda f: calls.append("a"), "b": lambda f: calls.append("b")}, {}, 1, 2, 3, 1)
    assert {k: len(v) for k, v in times.items()} == {"a": 6, "b": 6} and calls[:2] == ["a", "b"] and calls[5:8] == ["b", "b", "b"]
