"""`cache gc` while a search runs: every stage a trial (or a Ray task) reads is leased, and an
entry pruned between two tasks is rebuilt, never a FileNotFoundError (issue 22)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from reliability_fixtures import onnx_recipe, plugin_env, write_linear_onnx, write_recipe

from optpipe.cache.admin import collect_garbage
from optpipe.cache.store import StageCache, LeaseSet
from optpipe.core.results import StageResult

SEARCH_STAGES = {
    "export": {"pass": "export"},
    "simplify": {"pass": "simplify", "after": "export", "search": {"backend": ["onnxslim", "onnxsim"]}},
    "int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"}, "search": {"per_channel": [True, False]}},
}


def _gc_until(stop: threading.Event, root: Path, pruned: list[int]) -> None:
    """`cache gc --max-size 0` every 0.2 s (the issue's reproduction used 0.5 s)."""
    while not stop.is_set():
        if (root / "CACHEDIR.TAG").exists():
            pruned.append(len(collect_garbage(root, None, 0).removed))
        time.sleep(0.2)


def test_gc_max_size_0_during_a_grid_search_does_not_crash_it(tmp_path):
    write_linear_onnx(tmp_path / "model")
    recipe = write_recipe(tmp_path, onnx_recipe(tmp_path, stages=SEARCH_STAGES,
                                                 evaluate={"warmup": 1, "iterations": 3, "batch_sizes": [1], "eager_baseline": False,
                                                           "search": {"strategy": "grid", "objectives": ["accuracy", "size"]}}))
    stop, pruned = threading.Event(), []
    gc = threading.Thread(target=_gc_until, args=(stop, tmp_path / "cache", pruned), daemon=True)
    gc.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "optpipe.cli", "compile", str(recipe)], cwd=tmp_path, env=plugin_env(),
                              capture_output=True, text=True, timeout=600)
    finally:
        stop.set()
        gc.join(timeout=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "internal error" not in proc.stderr and "FileNotFoundError" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert len(report["search"]["trials"]) == 4 and all(t["status"] == "ok" for t in report["search"]["trials"]), report["search"]
    assert sum(pruned) > 0, "the gc pruned something while the search ran (else the test tests nothing)"


def test_a_lease_set_keeps_an_entry_from_gc_until_closed(tmp_path):
    cache = StageCache(tmp_path / "cache")
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(b"m")
    entry = cache.publish_folder("b" * 64, workdir, "stages")
    cache.release_leases()
    held = LeaseSet(cache.root)
    held.hold("b" * 64)
    cache.release_leases()  # a task's end drops its own leases, not the set's
    assert collect_garbage(cache.root, None, 0).removed == [] and entry.exists()
    held.close()
    assert len(collect_garbage(cache.root, None, 0).removed) == 1 and not entry.exists()


def test_a_parent_pruned_between_two_tasks_is_rebuilt(tmp_path):
    from optpipe.execution.stage_tasks import TaskSettings, run_stage
    from optpipe.plan.compile_plan import CompilePlan
    from optpipe.safety.recipe_loading import load_recipe

    write_linear_onnx(tmp_path / "model")
    recipe = load_recipe(write_recipe(tmp_path, onnx_recipe(tmp_path)))
    settings = TaskSettings(cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")
    export = run_stage(CompilePlan.of(recipe), "export", None, settings)
    assert export.status == "ok"
    assert len(collect_garbage(tmp_path / "cache", None, 0).removed) >= 1 and not export.model.folder.exists()
    simplify = run_stage(CompilePlan.of(recipe), "simplify", export, settings)
    assert simplify.status == "ok", simplify.reason
    assert export.model.folder.exists(), "the parent was rebuilt under its own key"
    assert isinstance(simplify, StageResult)
