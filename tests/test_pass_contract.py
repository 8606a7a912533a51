"""The pass contract is enforced by the manager, for a pass from outside the package (OPTPIPE_PLUGINS):
a stray workdir file, a mutated input and a wrong return value fail the stage with one line naming
the pass and the file; data sets a pass reads join its cache key without the pass declaring them."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from optpipe.passes import registry
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def contract_plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    # A plugin must be importable where the pass runs: here, and in a stage's worker process.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OPTPIPE_PLUGINS", "contract_passes")
    registry.cache_clear()
    yield
    monkeypatch.delenv("OPTPIPE_PLUGINS")
    registry.cache_clear()
    sys.modules.pop("contract_passes", None)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache for the module: the export stage is computed once."""
    return tmp_path_factory.mktemp("contract-cache")


def _compile(tiny_recipe, cache_dir, stages: dict, **overrides):
    stages = {"simplify": None, **stages}  # only export and the stage under test
    recipe = load_recipe(tiny_recipe({"stages": stages, "evaluate": {"eager_baseline": False}, **overrides}))
    return compile_recipe(recipe, RunOptions(cache_dir=cache_dir))


@pytest.mark.parametrize("timeout_s", [None, 120], ids=["in-process", "worker"])
def test_stray_file_in_workdir_fails_the_stage_naming_pass_and_file(tiny_recipe, cache_dir, timeout_s):
    stray = {"pass": "contract-stray", "after": "export", "params": {"stray": "calib.cache"}}
    if timeout_s:
        stray["timeout_s"] = timeout_s
    report = _compile(tiny_recipe, cache_dir, {"stray": stray})
    stage = report.stage("stray")
    assert stage.status == "failed"
    assert "pass 'contract-stray' left 'calib.cache' in its workdir" in stage.reason
    assert report.stage("export").status == "ok"


@pytest.mark.parametrize("timeout_s", [None, 120], ids=["in-process", "worker"])
def test_pass_that_edits_its_input_fails_and_the_cache_recomputes_the_input(tiny_recipe, cache_dir, timeout_s):
    mutate = {"pass": "contract-mutate", "after": "export"}
    if timeout_s:
        mutate["timeout_s"] = timeout_s
    report = _compile(tiny_recipe, cache_dir, {"mutate": mutate})
    stage = report.stage("mutate")
    assert stage.status == "failed"
    assert "pass 'contract-mutate' modified its input artifact (model.onnx.data)" in stage.reason
    # The edited entry fails verification on the next lookup: export runs again instead of serving it.
    again = _compile(tiny_recipe, cache_dir, {})
    assert again.stage("export").status == "ok" and not again.stage("export").cached


def test_returned_artifact_must_be_the_workdir(tiny_recipe, cache_dir):
    report = _compile(tiny_recipe, cache_dir, {"wrong": {"pass": "contract-wrong-return", "after": "export"}})
    assert report.stage("wrong").status == "failed"
    assert "pass 'contract-wrong-return' returned an artifact in" in report.stage("wrong").reason


def _cache_hit(run_dir: Path, stage: str) -> bool:
    """The stage's model came from the cache, as its log says (report.json's `cached`; `evaluation_cached` is its figures')."""
    return "cache hit" in (run_dir / "logs" / f"{stage}.log").read_text()


def test_data_set_read_by_a_pass_joins_its_cache_key(tiny_recipe, cache_dir, tmp_path):
    stages = {"scaled": {"pass": "contract-scale-by-data", "after": "export"}}
    first = _compile(tiny_recipe, cache_dir, stages)
    assert first.stage("scaled").status == "ok" and not first.stage("scaled").cached
    _compile(tiny_recipe, cache_dir, stages)
    assert _cache_hit(tmp_path / "run", "scaled"), "same data: a cache hit"

    other_data = {"data": {"eval": {"source": "synthetic", "samples": 16, "seed": 7}}}
    changed = _compile(tiny_recipe, cache_dir, stages, **other_data)
    assert _cache_hit(tmp_path / "run", "export"), "export does not read the evaluation set"
    assert not _cache_hit(tmp_path / "run", "scaled"), "the pass read the evaluation set: new data, new key"
    assert changed.stage("scaled").info["factor"] != first.stage("scaled").info["factor"]
