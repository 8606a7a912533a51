"""The pass manager and evaluation: branches, failures, injected numeric errors, the report."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from optpipe.core.artifact import save_model
from optpipe.core.errors import PassError
from optpipe.pass_infra.pass_base import Pass, PassParams
from optpipe.passes import register_pass, unregister_pass
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe


class ExplodeParams(PassParams):
    message: str = "boom"


class ExplodePass(Pass):
    """Always fails, as a broken pass would."""

    name = "test-explode"
    Params = ExplodeParams

    def run(self, model, ctx):
        raise PassError(self.params.message)


class BuggyPass(Pass):
    """Raises an unexpected exception, as a bug would."""

    name = "test-buggy"

    def run(self, model, ctx):
        return {}["missing"]


class PerturbParams(PassParams):
    scale: float = 0.5


class PerturbPass(Pass):
    """Adds noise to every weight: an injected numeric error the evaluation must catch."""

    name = "test-perturb"
    Params = PerturbParams

    def run(self, model, ctx):
        proto = model.load()
        rng = np.random.default_rng(0)
        for init in proto.graph.initializer:
            array = numpy_helper.to_array(init)
            if array.dtype == np.float32 and array.size > 1:
                noisy = array + rng.normal(0, self.params.scale, array.shape).astype(np.float32)
                init.CopyFrom(numpy_helper.from_array(noisy, init.name))
        return save_model(proto, ctx.workdir, {"perturbed": self.params.scale})


@pytest.fixture(autouse=True)
def test_passes():
    for cls in (ExplodePass, BuggyPass, PerturbPass):
        register_pass(cls)
    yield
    for cls in (ExplodePass, BuggyPass, PerturbPass):
        unregister_pass(cls.name)


def test_failing_branch_leaves_siblings_finished(tiny_recipe, cli_run, tmp_path):
    stages = {
        "broken": {"pass": "test-explode", "after": "export", "params": {"message": "no luck"}},
        "after_broken": {"pass": "simplify", "after": "broken"},
        "buggy": {"pass": "test-buggy", "after": "export"},
    }
    result = cli_run("compile", str(tiny_recipe({"stages": stages})))
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    status = {s["name"]: s["status"] for s in report["stages"]}
    assert status == {"pytorch-eager": "ok", "export": "ok", "simplify": "ok", "broken": "failed",
                      "after_broken": "skipped", "buggy": "failed"}
    by_name = {s["name"]: s for s in report["stages"]}
    assert "no luck" in by_name["broken"]["reason"] and "logs/broken.log" in by_name["broken"]["reason"]
    assert "parent stage 'broken' failed" in by_name["after_broken"]["reason"]
    assert "internal error in pass 'test-buggy' (KeyError" in by_name["buggy"]["reason"]
    assert "KeyError" in (tmp_path / "run" / "logs" / "buggy.log").read_text(), "the traceback goes to the log"
    assert by_name["simplify"]["accuracy"]["within_tolerance"]
    assert (tmp_path / "run" / "stages" / "simplify" / "model.onnx").exists()
    assert "error: stage 'broken' failed: no luck" in result.output


def test_injected_numeric_error_is_caught(tiny_recipe, cache_dir):
    stages = {"noisy": {"pass": "test-perturb", "after": "simplify", "params": {"scale": 0.5}}}
    report = compile_recipe(load_recipe(tiny_recipe({"stages": stages})), RunOptions(cache_dir=cache_dir))
    noisy = report.stage("noisy")
    assert noisy.status == "ok"
    assert not noisy.accuracy.within_tolerance
    assert noisy.accuracy.worst_cosine < 0.999
    assert any("cosine" in v for v in noisy.accuracy.violations)
    assert "noisy" not in report.pareto, "a model out of tolerance is never offered"
    assert report.stage("simplify").accuracy.within_tolerance


def test_slight_perturbation_within_tolerance_passes(tiny_recipe, cache_dir):
    stages = {"nudged": {"pass": "test-perturb", "after": "simplify", "params": {"scale": 1e-6}}}
    report = compile_recipe(load_recipe(tiny_recipe({"stages": stages})), RunOptions(cache_dir=cache_dir))
    assert report.stage("nudged").accuracy.within_tolerance


def test_report_has_accuracy_latency_size_and_frontier(tiny_recipe, cache_dir, tmp_path):
    path = tiny_recipe({"evaluate": {"batch_sizes": [1, 4]}})
    report = compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir))
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert data["schema_version"] == 3 and data["reference"] == "export"
    export = next(s for s in data["stages"] if s["name"] == "export")
    assert [lat["batch_size"] for lat in export["latency"]] == [1, 4]
    lat = export["latency"][0]
    assert 0 < lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"]
    assert lat["throughput"] > 0
    assert export["size_bytes"] > 0 and export["hash"]
    assert export["accuracy"]["outputs"][0]["cosine_mean"] == pytest.approx(1.0)
    eager = next(s for s in data["stages"] if s["name"] == "pytorch-eager")
    assert eager["accuracy"]["outputs"][0]["max_abs"] < 1e-4, "the export matches PyTorch eager"
    assert report.pareto and set(report.pareto) <= {"export", "simplify"}
    markdown = (tmp_path / "run" / "report.md").read_text()
    assert "| export | export |" in markdown and "Pareto frontier" in markdown


def test_only_runs_a_stage_and_its_ancestors(tiny_recipe, cache_dir):
    stages = {"other": {"pass": "test-explode", "after": "export"}}
    report = compile_recipe(load_recipe(tiny_recipe({"stages": stages})), RunOptions(cache_dir=cache_dir, only="simplify"))
    assert {s.name for s in report.stages} == {"pytorch-eager", "export", "simplify"}
    assert not report.failed


def test_reference_can_be_another_stage(tiny_recipe, cache_dir):
    report = compile_recipe(load_recipe(tiny_recipe({"evaluate": {"reference": "simplify"}})), RunOptions(cache_dir=cache_dir))
    assert report.reference == "simplify"
    assert report.stage("export").accuracy.reference == "simplify"
