"""Warnings a pass's info carries that its figures do not show: int8 ranges from made-up data, and a
guard that kept every converted node in float."""
from __future__ import annotations

from optpipe.calibration.dataset import build_sample_set
from optpipe.evaluation.verdict import pass_warnings
from optpipe.safety.recipe_loading import parse_recipe


def test_a_sample_set_knows_its_source_and_synthetic_calibration_warns(tmp_path):
    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": ["batch", 4]}],
                           "dims": {"batch": {"min": 1, "opt": 2, "max": 4}},
                           "data": {"calibration": {"source": "synthetic", "samples": 4}}, "stages": {"export": {"pass": "export"}}})
    samples = build_sample_set(recipe.data.calibration, recipe.model_source(), tmp_path / "cache")
    assert samples.origin == "synthetic"
    assert build_sample_set(recipe.data.calibration, recipe.model_source(), tmp_path / "cache").origin == "synthetic"  # cached too
    [warning] = pass_warnings({"calibration": {"source": samples.origin}})
    assert "calibrated on synthetic data" in warning and "U(-1,1)" in warning
    assert pass_warnings({"calibration": {"source": "images"}}) == []
    assert pass_warnings({"int8": {"calibration": {"source": "synthetic"}}})  # OpenVINO's NNCF info


def test_a_guard_that_kept_everything_in_float_warns():
    [warning] = pass_warnings({"guard": {"unconverted": "all 1 node(s) this pass converts are kept in float"}})
    assert warning.startswith("guard: all 1 node(s)")
