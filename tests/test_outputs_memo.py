"""The in-process memo of a model's outputs (optpipe.evaluation.outputs_memo) behind `run_onnx`.

What decides the numbers is in the key (model bytes and external data, inputs, threads,
providers); the same model in another folder hits; an oversized value is not kept; callers
cannot corrupt it; and a compile with the memo reports exactly the figures it reports
without, with fewer model runs.
"""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from helpers_passes import small_mlp
from optpipe.core.artifact import DATA_FILE, save_model
from optpipe.evaluation import accuracy, outputs_memo
from optpipe.evaluation.outputs_memo import OutputsMemo

RUN_ONNX = accuracy._run_onnx  # what really runs a model: the spies count its calls

def mlp(seed: int = 0) -> onnx.ModelProto:
    return small_mlp(np.random.default_rng(seed))


def batches(seed: int = 1, count: int = 2, size: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, 16)).astype(np.float32)} for _ in range(count)]


@pytest.fixture
def memo(monkeypatch):
    """A fresh memo for this test, and a count of the real model runs behind `run_onnx`."""
    fresh = OutputsMemo()
    monkeypatch.setattr(outputs_memo, "MEMO", fresh)
    runs = []
    monkeypatch.setattr(accuracy, "_run_onnx", lambda *a, **k: runs.append(a[0]) or RUN_ONNX(*a, **k))
    fresh.runs = runs
    return fresh


def test_same_model_same_inputs_runs_once_even_from_another_folder(tmp_path, memo):
    first = save_model(mlp(), tmp_path / "a")
    copy = tmp_path / "b"
    shutil.copytree(first.folder, copy)
    feeds = batches()
    a = accuracy.run_onnx(first.path, feeds, threads=1)
    b = accuracy.run_onnx(copy / "model.onnx", [dict(f) for f in feeds], threads=1)
    assert len(memo.runs) == 1 and memo.hits == 1 and memo.misses == 1
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("change", ["model", "external data", "inputs", "batching", "threads", "providers"])
def test_whatever_can_change_the_numbers_is_a_miss(tmp_path, memo, change):
    artifact = save_model(mlp(), tmp_path / "a")
    accuracy.run_onnx(artifact.path, batches(), threads=1)
    path, feeds, threads, providers = artifact.path, batches(), 1, None
    if change == "model":
        path = save_model(mlp(seed=5), tmp_path / "b").path
    elif change == "external data":  # the same .onnx bytes, other weights beside it
        other = save_model(mlp(seed=5), tmp_path / "b")
        path = tmp_path / "c" / "model.onnx"
        shutil.copytree(artifact.folder, path.parent)
        shutil.copyfile(other.folder / DATA_FILE, path.parent / DATA_FILE)
        assert path.read_bytes() == artifact.path.read_bytes()
    elif change == "inputs":
        feeds[1]["x"] = feeds[1]["x"].copy()
        feeds[1]["x"][3, 15] += 1e-6
    elif change == "batching":  # the same samples, batched otherwise
        feeds = [{"x": np.concatenate([b["x"] for b in batches()])}]
    elif change == "threads":
        threads = 2
    if change == "providers":  # no second provider on a CPU machine: the key alone must differ
        cpu = outputs_memo.run_key(path, feeds, threads)
        assert cpu != outputs_memo.run_key(path, feeds, threads, ["CUDAExecutionProvider", "CPUExecutionProvider"])
        assert cpu == outputs_memo.run_key(path, feeds, threads, ["CPUExecutionProvider"])
        return
    accuracy.run_onnx(path, feeds, threads, providers)
    assert len(memo.runs) == 2 and memo.hits == 0


def test_a_prebuilt_session_keys_like_the_one_run_onnx_builds(tmp_path, memo):
    from optpipe.core.runtime import ort_session

    artifact = save_model(mlp(), tmp_path / "a")
    accuracy.run_onnx(artifact.path, batches(), threads=1)
    accuracy.run_onnx(artifact.path, batches(), threads=1, session=ort_session(artifact.path, 1))
    assert len(memo.runs) == 1
    accuracy.run_onnx(artifact.path, batches(), threads=1, session=ort_session(artifact.path, 1, optimization="disable"))
    assert len(memo.runs) == 2, "another graph optimization level is another computation"


def test_values_are_read_only_and_callers_cannot_corrupt_the_memo(tmp_path, memo):
    artifact = save_model(mlp(), tmp_path / "a")
    first = accuracy.run_onnx(artifact.path, batches(), threads=1)
    kept = first["y"].copy()
    with pytest.raises(ValueError):
        first["y"][0, 0] = 123.0
    first["extra"] = np.zeros(1)
    first.pop("y")
    again = accuracy.run_onnx(artifact.path, batches(), threads=1)
    assert set(again) == {"y"} and np.array_equal(again["y"], kept)
    with pytest.raises(ValueError):
        again["y"] += 1


def test_a_value_bigger_than_the_cap_is_not_kept_and_the_oldest_goes_first(tmp_path, monkeypatch):
    y = np.zeros((8, 8), np.float32)  # 256 bytes
    memo = OutputsMemo(cap_bytes=600)
    assert not memo.put("big", {"y": np.zeros((8, 32), np.float32)}, 1.0) and "big" not in memo
    for key in ("a", "b", "c"):
        assert memo.put(key, {"y": y.copy()}, 1.0)
    assert "a" not in memo and "b" in memo and "c" in memo and memo.bytes == 512
    memo.get("b")  # used: now the newest
    memo.put("d", {"y": y.copy()}, 1.0)
    assert "c" not in memo and "b" in memo and "d" in memo

    small = OutputsMemo(cap_bytes=10)  # through run_onnx: computed every time, never kept
    monkeypatch.setattr(outputs_memo, "MEMO", small)
    artifact = save_model(mlp(), tmp_path / "a")
    accuracy.run_onnx(artifact.path, batches(), threads=1)
    accuracy.run_onnx(artifact.path, batches(), threads=1)
    assert small.misses == 2 and small.hits == 0 and small.bytes == 0


# --- a compile: the same figures, fewer runs --------------------------------------------------

def _compile(tiny_recipe, tmp_path, monkeypatch, memo: OutputsMemo, name: str):
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    onnx.save_model(mlp(), str(tmp_path / "mlp.onnx"))
    monkeypatch.setattr(outputs_memo, "MEMO", memo)
    runs = []
    monkeypatch.setattr(accuracy, "_run_onnx", lambda *a, **k: runs.append(a[0]) or RUN_ONNX(*a, **k))
    stages = {
        "export": {"pass": "export"},
        # Two guarded int8 stages on the same input: the second guard's reference is the first's.
        "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}},
        "int8-tensor": {"pass": "int8", "after": "export", "params": {"mode": "dynamic", "per_channel": False}},
    }
    recipe = tiny_recipe({"model": None, "stages": None, "inputs": None}, name=f"{name}.yaml", model={"onnx": str(tmp_path / "mlp.onnx")},
                         inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 16]}], stages=stages,
                         output=str(tmp_path / f"run-{name}"))
    report = compile_recipe(load_recipe(recipe), RunOptions(cache_dir=tmp_path / f"cache-{name}"))
    figures = {s.name: s.accuracy.model_dump(mode="json") for s in report.stages if s.accuracy is not None}
    guards = {s.name: s.info["guard"]["cosine"] for s in report.stages if "guard" in (s.info or {})}
    return figures, guards, runs


def test_a_compile_with_the_memo_reports_the_same_figures_with_fewer_runs(tiny_recipe, tmp_path, monkeypatch):
    without, guards_without, runs_without = _compile(tiny_recipe, tmp_path, monkeypatch, OutputsMemo(cap_bytes=0), "off")
    memo = OutputsMemo()
    with_memo, guards_with, runs_with = _compile(tiny_recipe, tmp_path, monkeypatch, memo, "on")
    assert set(without) == {"export", "int8", "int8-tensor"}
    assert with_memo == without and guards_with == guards_without, "bit-identical figures"
    # Saved: the second guard's reference (export's outputs), export's evaluation (the reference
    # stage), and each int8 stage's evaluation (the guard's final measurement, re-saved as published).
    assert len(runs_without) == 7 and len(runs_with) == 3, (runs_with, runs_without)
    assert memo.hits == 4


def test_a_file_that_is_not_onnx_gets_the_runtime_s_own_error_not_the_memo_s(tmp_path, memo):
    bogus = tmp_path / "model.onnx"
    bogus.write_bytes(b"not a model")
    assert outputs_memo.run_key(bogus, batches(), 1) is None
    with pytest.raises(Exception, match="INVALID_PROTOBUF"):  # ONNX Runtime's, as without the memo
        accuracy.run_onnx(bogus, batches(), threads=1)
