"""The content-addressed cache: hit, miss, invalidation by params, corrupted entries."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper, numpy_helper

from optpipe.core.artifact import save_model
from optpipe.cache.store import StageCache, verify_entry
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe


def _tiny_model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.full((64, 64), 0.5, np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [1, 64])],
                              [helper.make_tensor_value_info("y", 1, [1, 64])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _publish(cache: StageCache, key: str):
    workdir = cache.new_workdir()
    save_model(_tiny_model(), workdir, {"note": "test"})
    return cache.publish(key, workdir)


def test_publish_then_lookup_returns_the_entry(tmp_path):
    cache = StageCache(tmp_path)
    key = StageCache.key(a=1)
    published = _publish(cache, key)
    found = cache.lookup(key)
    assert found is not None and found.folder == published.folder
    assert found.info == {"note": "test"}
    assert found.content_hash() == published.content_hash()
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.is_dir()], "the workdir was moved, not copied"


def test_key_is_canonical_and_sensitive():
    assert StageCache.key(a=1, b={"x": 1, "y": 2}) == StageCache.key(b={"y": 2, "x": 1}, a=1)
    assert StageCache.key(a=1) != StageCache.key(a=2)


def test_truncated_entry_is_detected_and_dropped(tmp_path):
    cache = StageCache(tmp_path)
    key = StageCache.key(a=2)
    entry = _publish(cache, key)
    data = entry.folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    assert "does not match" in verify_entry(entry.folder)
    assert cache.lookup(key) is None
    assert not entry.folder.exists()


def test_entry_without_manifest_is_not_trusted(tmp_path):
    cache = StageCache(tmp_path)
    key = StageCache.key(a=3)
    entry = _publish(cache, key)
    (entry.folder / "entry.json").unlink()
    assert cache.lookup(key) is None


def test_tampered_manifest_is_detected(tmp_path):
    cache = StageCache(tmp_path)
    key = StageCache.key(a=4)
    entry = _publish(cache, key)
    manifest = json.loads((entry.folder / "entry.json").read_text())
    manifest["content"] = "0" * 64
    (entry.folder / "entry.json").write_text(json.dumps(manifest))
    assert cache.lookup(key) is None


def test_rerun_hits_and_param_change_recomputes_only_that_stage_and_descendants(tiny_recipe, cache_dir):
    def recipe(atol: float):
        stages = {
            "sim": {"pass": "simplify", "after": "simplify", "params": {"backend": "onnxsim", "check_atol": atol}},
            "sim2": {"pass": "simplify", "after": "sim", "params": {"check_atol": 0.01}},
        }
        return load_recipe(tiny_recipe({"stages": stages}))

    first = compile_recipe(recipe(1e-3), RunOptions(cache_dir=cache_dir))
    assert [s.name for s in first.stages if s.cached] == []
    again = compile_recipe(recipe(1e-3), RunOptions(cache_dir=cache_dir))
    assert all(s.cached for s in again.stages), [(s.name, s.cached) for s in again.stages]
    changed = compile_recipe(recipe(2e-3), RunOptions(cache_dir=cache_dir))
    cached = {s.name: s.cached for s in changed.stages}
    assert cached["export"] and cached["simplify"], "upstream of the change: reused"
    assert not cached["sim"], "its params changed"
    # sim2's input is sim's output: same bytes as before (the param only loosens a check), so the
    # content-addressed key finds it again; the pass manager keys by content, not by position.
    assert cached["sim2"]


def test_force_recomputes(tiny_recipe, cache_dir):
    path = tiny_recipe()
    compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir))
    forced = compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir, force=True))
    assert not forced.stage("export").cached and not forced.stage("simplify").cached


def test_corrupted_stage_is_recomputed_by_the_next_run(tiny_recipe, cache_dir):
    path = tiny_recipe()
    compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir))
    for data in (cache_dir / "stages").glob("*/model.onnx.data"):
        data.write_bytes(b"garbage")
    report = compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir))
    assert report.stage("export").status == "ok" and not report.stage("export").cached
    assert report.stage("simplify").status == "ok"
    assert report.stage("export").accuracy.within_tolerance


def test_new_calibration_or_evaluation_data_recomputes_exactly_the_stages_that_read_it(tmp_path):
    """int8/fp16 no longer put data-set keys in their fingerprints: the runner adds what each pass read."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from reliability_fixtures import onnx_recipe, write_linear_onnx, write_recipe

    write_linear_onnx(tmp_path / "model")
    rng = np.random.default_rng(0)

    def data(name: str, seed_shift: float = 0.0) -> dict:
        np.savez(tmp_path / f"{name}.npz", x=(rng.standard_normal((8, 16)) + seed_shift).astype(np.float32))
        return {"source": "npz", "path": f"{name}.npz", "samples": 8}

    stages = {"export": {"pass": "export"},
              "int8": {"pass": "int8", "after": "export", "params": {"mode": "static", "guard": False}},
              "fp16": {"pass": "fp16", "after": "export", "params": {"guard": False}}}
    recipe = onnx_recipe(tmp_path, stages=stages, cache=str(tmp_path / "cache"))
    recipe["data"] = {"eval": data("eval"), "calibration": data("calibration")}
    path = write_recipe(tmp_path, recipe)

    def keys() -> dict[str, str]:
        """Each stage's cache entry (its folder is named by the stage's key)."""
        report = compile_recipe(load_recipe(path), RunOptions())
        return {s.name: s.model.path.parent.name for s in report.stages if s.name in stages}

    first = keys()
    assert keys() == first  # nothing changed: every key the same
    data("calibration", seed_shift=1.0)  # same file name, new content: only the stage calibrated on it changes key
    recalibrated = keys()
    assert recalibrated["int8"] != first["int8"] and {k: recalibrated[k] for k in ("export", "fp16")} == {k: first[k] for k in ("export", "fp16")}
    data("eval", seed_shift=1.0)  # both guards measure on the evaluation set (guard off: they still report it)
    evaluated = keys()
    assert evaluated["export"] == first["export"]
    assert evaluated["int8"] not in (first["int8"], recalibrated["int8"]) and evaluated["fp16"] != first["fp16"]
