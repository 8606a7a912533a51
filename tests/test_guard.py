"""The one accuracy guard (optpipe.evaluation.guard): a third pass-like use of it, its budget, and its verdict.

A guard that gives up must never read as success: the report's verdict is the stricter of
the guard's figure (e.g. emulated FP16) and the report's own (a CPU provider that computes
FP16 in FP32).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import yaml
from onnx import numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe, small_mlp
from optpipe.evaluation.guard import AccuracyGuard, GuardParams
from optpipe.evaluation.guard_verdict import fold_guard_verdict
from optpipe.pass_infra.pass_base import PassParams
from optpipe.core.results import Accuracy, OutputAccuracy

RNG = np.random.default_rng(0)

def chain_model() -> onnx.ModelProto:
    return small_mlp(RNG)


def ternary_weights(source: onnx.ModelProto, keep_float: list[str]) -> onnx.ModelProto:
    """A lossy 'pass': every MatMul weight becomes sign(w) * mean|w|, except the nodes kept in float."""
    model = onnx.ModelProto()
    model.CopyFrom(source)
    lossy = {node.input[1] for node in model.graph.node if node.op_type == "MatMul" and node.name not in keep_float}
    for index, init in enumerate(model.graph.initializer):
        if init.name in lossy:
            w = numpy_helper.to_array(init)
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(np.sign(w) * np.abs(w).mean(), init.name))
    return model


class TernaryParams(PassParams, GuardParams):
    pass


def ternary_pass(model, ctx, params: TernaryParams):
    """The guard's docstring example, for real: a third pass in about ten lines."""
    source = model.load()
    result = AccuracyGuard(ctx, model, params, lambda excluded: ternary_weights(source, excluded)).run(params.exclude)
    return result


def chain_case(tmp_path, cosine_min: float, **tolerance):
    recipe = graph_recipe([{"name": "x", "shape": ["N", 16]}], dims={"N": {"min": 1, "opt": 4, "max": 16}},
                          tolerance={"cosine_min": cosine_min, **tolerance})
    arrays = {"x": RNG.normal(size=(16, 16)).astype(np.float32)}
    return artifact_of(chain_model(), tmp_path / "in"), context(recipe, tmp_path / "work", arrays)


def test_a_third_pass_uses_the_guard_and_it_keeps_the_nodes_that_break_the_tolerance(tmp_path):
    model, ctx = chain_case(tmp_path, cosine_min=0.995)
    result = ternary_pass(model, ctx, TernaryParams())
    report = result.report
    # Ternary weights on both MatMuls cost accuracy (measured cosine ~0.8); the guard keeps nodes in
    # float until it holds, and every node it kept bought cosine.
    assert not report.first.within_tolerance and report.first.cosine < 0.95
    assert report.held and report.gave_up is None and report.cosine >= 0.995
    assert report.excluded and set(report.excluded) <= {"mm1", "mm2"}
    assert all(step.bought_cosine > 0 for step in report.steps if step.kept)
    kept_float = {init.name for init in result.model.graph.initializer
                  if len(np.unique(np.abs(numpy_helper.to_array(init)))) > 1}
    assert kept_float == {"w1" if n == "mm1" else "w2" for n in report.excluded}


def test_an_unreachable_tolerance_gives_up_within_its_trial_budget_and_says_why(tmp_path):
    # max_abs 0 cannot hold while any weight is lossy, and the guard may keep only one node.
    model, ctx = chain_case(tmp_path, cosine_min=0.999999, max_abs=0.0)
    report = ternary_pass(model, ctx, TernaryParams(max_excluded=1)).report
    assert not report.held and "max_excluded: 1" in report.gave_up
    assert report.trials <= 2 and len(report.excluded) == 1

    model, ctx = chain_case(tmp_path / "trials", cosine_min=0.999999, max_abs=0.0)
    report = ternary_pass(model, ctx, TernaryParams(guard_trials=1)).report
    assert not report.held and report.trials == 1 and "guard_trials: 1" in report.gave_up


def test_the_guard_stops_when_its_time_budget_is_spent(tmp_path):
    model, ctx = chain_case(tmp_path, cosine_min=0.999999, max_abs=0.0)
    # A budget below one conversion: the guard measures the first conversion, then stops.
    report = ternary_pass(model, ctx, TernaryParams(guard_seconds=1e-6)).report
    assert not report.held and report.trials == 0 and "guard_seconds" in report.gave_up


def _accuracy(cosine: float, within: bool) -> Accuracy:
    output = OutputAccuracy(name="y", max_abs=1e-3, mean_abs=1e-4, cosine_mean=cosine, cosine_min=cosine)
    return Accuracy(reference="export", samples=4, outputs=[output], within_tolerance=within)


def test_the_stricter_figure_is_the_verdict_and_both_are_kept():
    gave_up = {"guard": {"numerics": "emulated FP16 storage", "held": False, "cosine": 0.0, "max_abs": 1.0,
                         "gave_up": "the guard is off (guard: false)"}}
    folded = fold_guard_verdict(_accuracy(0.99979, True), gave_up)
    assert not folded.within_tolerance and folded.guard.cosine == 0.0 and folded.worst_cosine == pytest.approx(0.99979)
    assert "emulated FP16 storage out of tolerance" in folded.violations[-1] and "guard: false" in folded.violations[-1]
    held = {"guard": {**gave_up["guard"], "held": True, "cosine": 0.9999, "gave_up": None}}
    # The guard holding never rescues a report figure that is out of tolerance.
    assert not fold_guard_verdict(_accuracy(0.5, False), held).within_tolerance
    assert fold_guard_verdict(_accuracy(0.9999, True), held).within_tolerance
    assert fold_guard_verdict(_accuracy(0.9999, True), {}).guard is None


# Logits of ~2e-8: below FP16's smallest normal (6.1e-5), so FP16 storage flushes them towards
# zero, while ONNX Runtime's CPU provider computes the "FP16" MatMul in FP32 and reports them fine.
TINY_LOGITS = """
<ir_version: 9, opset_import: ["" : 17]>
tiny (float[batch, 32] x) => (float[batch, 10] logits) {
  h = MatMul (x, w1)
  logits = MatMul (h, w2)
}
"""


def tiny_logits_recipe(tmp_path, fp16_params: dict, weight_scales=(1e-4, 1e-5), tolerance=None) -> tuple:
    model = parser.parse_model(TINY_LOGITS)
    model.graph.initializer.append(numpy_helper.from_array((RNG.normal(size=(32, 16)) * weight_scales[0]).astype(np.float32), "w1"))
    model.graph.initializer.append(numpy_helper.from_array((RNG.normal(size=(16, 10)) * weight_scales[1]).astype(np.float32), "w2"))
    onnx.save(model, str(tmp_path / "tiny.onnx"))
    recipe = {
        "name": "tiny-logits",
        "model": {"onnx": "tiny.onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 32]}],
        "dims": {"batch": {"min": 1, "opt": 4, "max": 16}},
        "data": {"eval": {"source": "synthetic", "samples": 16, "seed": 0}},
        "stages": {"export": {"pass": "export"}, "fp16": {"pass": "fp16", "after": "export", "params": fp16_params}},
        "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 3, "threads": 1, "eager_baseline": False,
                     "tolerance": tolerance or {"cosine_min": 0.99}},
        "output": str(tmp_path / "run"),
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path / "recipe.yaml"


@pytest.mark.parametrize("params", [{"guard": False}, {"max_excluded": 0}], ids=["guard-off", "guard-gives-up"])
def test_tiny_logits_fp16_is_out_of_tolerance_in_the_report_with_both_figures(tmp_path, cache_dir, params):
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    report = compile_recipe(load_recipe(tiny_logits_recipe(tmp_path, params)), RunOptions(cache_dir=cache_dir))
    stage = report.stage("fp16")
    assert stage.status == "ok" and stage.info["guard"]["gave_up"]
    accuracy = stage.accuracy
    # The CPU provider's figure alone would pass; the emulated FP16 figure does not, and wins.
    assert accuracy.guard.cosine < 0.99 < accuracy.worst_cosine
    assert not accuracy.within_tolerance and "fp16" not in report.pareto
    markdown = (tmp_path / "run" / "report.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| fp16 "))
    assert f"{accuracy.worst_cosine:.5f}" in row and f"guard {accuracy.guard.cosine:.5f}" in row
    assert "emulated FP16 storage out of tolerance" in markdown


def test_tiny_logits_fp16_guard_on_keeps_the_tiny_matmul_in_fp32(tmp_path, cache_dir):
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    report = compile_recipe(load_recipe(tiny_logits_recipe(tmp_path, {})), RunOptions(cache_dir=cache_dir))
    stage = report.stage("fp16")
    assert stage.info["guard"]["held"] and stage.accuracy.within_tolerance and stage.accuracy.guard.within_tolerance
    assert stage.info["guard"]["excluded"]


def test_a_guard_out_on_max_abs_names_max_abs_not_the_cosine_that_held(tmp_path, cache_dir):
    # Logits of ~1e3 (as a detector's pixel boxes): FP16 storage rounds them by ~0.5 (measured max abs
    # ~1-2), a direction error far too small to move the cosine off 1.0000. The tolerance's max_abs
    # is the criterion that fails, and the verdict must say so, with the figure and its limit.
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    recipe = tiny_logits_recipe(tmp_path, {"max_excluded": 0}, weight_scales=(10.0, 10.0),
                                tolerance={"cosine_min": 0.99, "max_abs": 0.05})
    report = compile_recipe(load_recipe(recipe), RunOptions(cache_dir=cache_dir))
    accuracy = report.stage("fp16").accuracy
    assert accuracy.guard.cosine > 0.9999 and not accuracy.guard.within_tolerance
    verdict = accuracy.violations[-1]
    assert "emulated FP16 storage out of tolerance" in verdict
    assert "max abs error" in verdict and "> 0.05" in verdict and "cosine" not in verdict
    assert "max abs error" in (tmp_path / "run" / "report.md").read_text().split("emulated FP16 storage")[-1]


def test_an_old_guard_report_without_violations_names_both_figures():
    old = {"guard": {"numerics": "emulated FP16 storage", "held": False, "cosine": 1.0, "max_abs": 83.0, "gave_up": None}}
    verdict = fold_guard_verdict(_accuracy(1.0, True), old).violations[-1]
    assert "cosine 1.00000" in verdict and "max abs error 83" in verdict


def test_when_blame_names_no_node_the_guard_falls_back_to_the_last_converted_nodes(tmp_path, monkeypatch):
    """Blame that finds nothing (an error it cannot localize) no longer ends the guard: it keeps the last
    converted nodes in float, within its budget, and says when nothing converted is left."""
    monkeypatch.setattr(AccuracyGuard, "blame", lambda self, model, skip: [])
    model, ctx = chain_case(tmp_path, cosine_min=0.9999)
    report = ternary_pass(model, ctx, TernaryParams()).report
    assert report.held and report.steps and report.steps[0].reason.startswith("fallback:"), report
    # No candidates given: every node is one (keeping the Relu too is harmless: it computes the same).
    assert report.excluded == ["mm1", "relu", "mm2"] and "all 3 node(s) this pass converts are kept in float" in report.unconverted


def test_a_fallback_beyond_the_budget_says_which_limit_to_raise(tmp_path, monkeypatch):
    monkeypatch.setattr(AccuracyGuard, "blame", lambda self, model, skip: [])
    model, ctx = chain_case(tmp_path, cosine_min=0.9999)
    report = ternary_pass(model, ctx, TernaryParams(max_excluded=1)).report
    assert not report.held and "(max_excluded: 1)" in report.gave_up, report.gave_up
