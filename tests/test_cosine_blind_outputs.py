"""Outputs whose cosine cannot tell a good stage from a broken one (optpipe/evaluation/variation.py): one value per
row (a regression head's [batch, 1], whose cosine is its sign) and values far from zero next to their spread.
A constant output, the reference's mean over the samples, would meet the cosine bound there; such outputs are held
by the share of the reference's variation across samples they reproduce (R² >= 2 * cosine_min - 1). An fp16 stage
of a model predicting ~1000 +- 0.2 read "ok, cosine 1.00000" while its outputs moved in steps of 0.5."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers_recipes import compile_recipe, small_recipe
from optpipe.evaluation.accuracy import compare
from optpipe.evaluation.variation import variation
from optpipe.recipe.schema import Tolerance

RNG = np.random.default_rng(0)


def _noisy(ref: np.ndarray, share: float) -> np.ndarray:
    """`ref` with noise of `share` of its spread across samples."""
    return (ref + RNG.normal(size=ref.shape) * ref.std(axis=0, keepdims=True) * share).astype(np.float32)


@pytest.mark.parametrize("shape, offset", [((64, 1), 0.0), ((64, 1), 1000.0), ((64, 4), 1000.0), ((64,), 500.0)])
def test_a_stage_that_loses_the_variation_is_out_of_tolerance_where_its_cosine_reads_1(shape, offset):
    ref = (offset + 0.2 * RNG.normal(size=shape)).astype(np.float32)
    broken = _noisy(ref, 0.6)  # R² ~ 0.64
    result = compare({"y": broken}, {"y": ref}, {"x": np.zeros((shape[0], 2), np.float32)}, Tolerance(cosine_min=0.99), "ref")
    out = result.outputs[0]
    assert out.explained is not None and out.explained < 0.8
    assert out.cosine_mean > 0.99 or offset == 0  # around 0, flipped signs show in the cosine too
    assert not result.within_tolerance and any("R²" in v and "cannot tell" in v for v in result.violations)
    assert result.figure().startswith("R² ") and result.error > 0.05
    scaled = compare({"y": (ref * 1.5).astype(np.float32)}, {"y": ref}, {"x": np.zeros((shape[0], 2), np.float32)}, Tolerance(cosine_min=0.99), "ref")
    assert not scaled.within_tolerance  # a row of one value keeps its sign: its cosine reads 1
    good = compare({"y": _noisy(ref, 0.05)}, {"y": ref}, {"x": np.zeros((shape[0], 2), np.float32)}, Tolerance(cosine_min=0.99), "ref")
    assert good.within_tolerance and good.outputs[0].explained > 0.99


def test_outputs_whose_cosine_tells_are_judged_by_it_alone():
    logits = RNG.normal(size=(32, 10)).astype(np.float32)  # rows point every way: the mean row scores ~0.3
    result = compare({"logits": _noisy(logits, 0.05)}, {"logits": logits}, {"x": logits}, Tolerance(cosine_min=0.99), "ref")
    assert result.outputs[0].explained is None and result.figure().startswith("cosine ")
    found = variation(logits, logits, None)
    assert found is not None and found.constant_cosine < 0.5


def test_only_the_blind_output_is_held_by_r2_beside_one_the_cosine_judges():
    logits = RNG.normal(size=(32, 10)).astype(np.float32)
    price = (1000 + RNG.normal(size=(32, 1))).astype(np.float32)
    result = compare({"logits": logits, "price": _noisy(price, 0.6)}, {"logits": logits, "price": price}, {"x": logits},
                     Tolerance(cosine_min=0.99), "ref")
    assert [o.explained is None for o in result.outputs] == [True, False]
    assert result.worst_cosine == pytest.approx(1.0) and ", R² " in result.figure()
    assert any("'price'" in v and "R²" in v for v in result.violations)


def test_padding_rows_are_left_out_of_the_variation():
    ref = (100 + RNG.normal(size=(8, 6, 1))).astype(np.float32)
    mask = np.ones((8, 6), np.int64)
    mask[:, 4:] = 0
    cand = ref.copy()
    cand[:, 4:] += 50  # padded positions: nobody reads them
    result = compare({"y": cand}, {"y": ref}, {"attention_mask": mask}, Tolerance(cosine_min=0.99), "ref")
    assert result.outputs[0].explained == pytest.approx(1.0) and result.within_tolerance


def test_one_sample_or_an_output_that_never_moves_is_not_judged_by_r2():
    assert variation(np.ones((1, 1), np.float32), np.ones((1, 1), np.float32), None) is None
    still = np.full((8, 1), 3.0, np.float32)
    found = variation(still, still, None)
    assert found is not None and found.explained is None


def test_fp16_of_a_regression_far_from_zero_is_repaired_by_its_guard_and_refused_without(tmp_path, cli_run):
    (tmp_path / "price_model.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))\n"
        "    with torch.no_grad():\n"
        "        net[0].weight[0, 0] = 40.0\n"
        "        net[2].bias += 1000.0\n"
        "    return net\n")
    stages = {"export": {"pass": "export"}, "fp16": {"pass": "fp16", "after": "export"},
              "fp16-bare": {"pass": "fp16", "after": "export", "params": {"guard": False}}}
    recipe = small_recipe({"factory": "price_model:build", "path": "."}, stages=stages, samples=64)
    recipe["evaluate"]["tolerance"] = {"cosine_min": 0.99}
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    bare = stages["fp16-bare"]["accuracy"]
    assert bare["outputs"][0]["cosine_mean"] > 0.9999  # the cosine: "ok"
    assert not bare["within_tolerance"] and bare["outputs"][0]["explained"] < 0.9  # measured: R² 0.51
    guarded = stages["fp16"]
    assert guarded["accuracy"]["within_tolerance"] and guarded["accuracy"]["outputs"][0]["explained"] >= 0.98
    assert "R² " in (tmp_path / "run" / "report.md").read_text()
    listing = cli_run("inspect", str(tmp_path / "run"))
    assert listing.exit_code == 0 and "R² " in listing.output and "(cosine cannot tell)" in listing.output
    stage = cli_run("inspect", str(tmp_path / "run"), "fp16-bare")
    assert "(the cosine cannot tell)" in stage.output and "OUT OF TOLERANCE" in stage.output


def test_a_guard_ranks_tries_that_all_miss_by_the_error_the_verdict_reads_not_the_cosine():
    # Tries of a regression head that all miss: one reproduces 0.6 of the variation, one 0.99 with a single sample
    # further off. Cosine ties at 1 (one value per row), so the largest error had decided, and kept the worse.
    from optpipe.evaluation.guard_types import attempt_score

    ref = (1000 + 0.2 * RNG.normal(size=(64, 1))).astype(np.float32)
    near = ref.copy()
    near[0] += 0.3
    far = _noisy(ref, 0.6)
    tolerance, inputs = Tolerance(cosine_min=0.9999), {"x": np.zeros((64, 2), np.float32)}
    near_result, far_result = (compare({"y": y}, {"y": ref}, inputs, tolerance, "ref") for y in (near, far))
    assert not near_result.within_tolerance and not far_result.within_tolerance
    assert near_result.outputs[0].max_abs > far_result.outputs[0].max_abs  # the old ranking's tie-break
    assert attempt_score(near_result) > attempt_score(far_result)
