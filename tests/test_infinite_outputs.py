"""A model that means -inf: action logits with illegal actions masked to -inf (RL policies, pointer networks,
constrained decoding). Its export was refused ("the pytorch-eager outputs NaN or Inf in 'output' (7 of 16 values);
check that the inputs' `range`/data fit the model"). ±inf where the reference has the same now compares equal;
NaN never does, and an infinity in one of the two stays an infinite error."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers_recipes import compile_recipe, small_recipe
from optpipe.core.runtime import first_non_finite
from optpipe.evaluation.accuracy import compare
from optpipe.recipe.schema import Tolerance

RNG = np.random.default_rng(5)


def _masked(logits: np.ndarray, legal: np.ndarray) -> np.ndarray:
    return np.where(legal, logits, -np.inf).astype(np.float32)


def test_shared_infinities_compare_equal_and_the_finite_values_carry_the_figures():
    legal = RNG.uniform(size=(16, 8)) > 0.4
    legal[:, 0] = True
    ref = _masked(RNG.normal(size=(16, 8)), legal)
    close = _masked(np.where(legal, ref, 0) + RNG.normal(scale=1e-3, size=ref.shape), legal)
    acc = compare({"logits": close}, {"logits": ref}, {}, Tolerance(cosine_min=0.99, max_abs=0.01, rtol=0.0), "ref")
    assert acc.within_tolerance, acc.violations
    out = acc.outputs[0]
    assert out.finite and np.isfinite(out.max_abs) and out.max_abs < 0.01 and out.cosine_mean > 0.999
    assert acc.polygraphy_match is True  # inf - inf is NaN to Polygraphy: zeroed before it as well
    assert out.top1 == 1.0 and out.input_sensitivity is not None


@pytest.mark.parametrize("broken", ["finite where -inf", "inf where finite", "nan"])
def test_an_infinity_in_one_only_or_a_nan_is_a_violation(broken):
    legal = np.ones((8, 6), bool)
    legal[:, 3] = False
    ref = _masked(RNG.normal(size=(8, 6)), legal)
    cand = ref.copy()
    if broken == "finite where -inf":
        cand[:, 3] = -1e4  # a quantizer's clamp of -inf: softmax-equal, not the same output
    elif broken == "inf where finite":
        cand[0, 0] = np.inf  # an overflow
    else:
        cand[0, 0] = np.nan
    acc = compare({"logits": cand}, {"logits": ref}, {}, Tolerance(cosine_min=0.99), "ref")
    assert not acc.within_tolerance and "NaN or Inf values unlike the reference's" in acc.violations[0]


def test_first_non_finite_allows_the_references_own_infinities_never_nan():
    ref = {"y": np.array([[0.0, -np.inf], [1.0, 2.0]], np.float32)}
    assert first_non_finite(ref) == ("y", 1, 4)
    assert first_non_finite(ref, like=ref) is None
    assert first_non_finite({"y": np.array([[0.0, -np.inf], [np.inf, 2.0]], np.float32)}, like=ref) == ("y", 1, 4)
    nan = {"y": np.array([[np.nan, 1.0]], np.float32)}
    assert first_non_finite(nan, like=nan) == ("y", 1, 2)


def test_a_masked_logits_policy_compiles_through_export_int8_and_openvino(tmp_path, cli_run):
    (tmp_path / "policy_inf.py").write_text(
        "import torch\n"
        "class Policy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))\n"
        "    def forward(self, obs, legal):\n"
        "        return self.net(obs).masked_fill(legal == 0, float('-inf'))\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return Policy()\n")
    inputs = [{"name": "obs", "dtype": "float32", "shape": ["batch", 16]},
              {"name": "legal", "dtype": "int64", "shape": ["batch", 8], "range": [0, 2]}]
    stages = {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}},
              "ov-fp32": {"pass": "openvino", "after": "export", "params": {"precision": "fp32"}}}
    recipe = small_recipe({"factory": "policy_inf:build", "path": "."}, inputs=inputs, stages=stages, samples=32)
    recipe["evaluate"]["tolerance"] = {"cosine_min": 0.99}
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    for name in ("export", "int8", "ov-fp32"):
        assert stages[name]["status"] == "ok" and stages[name]["accuracy"]["within_tolerance"], (name, stages[name].get("reason"))


def test_top1_of_masked_logits_is_read_on_the_logits_as_given():
    """With the shared -inf zeroed for the error figures, a masked action (0) outranked legal logits that are all
    negative, in both: top-1 read 1.0 where the legal choice flipped."""
    ref = np.array([[-1.0, -2.0, -np.inf], [-3.0, -1.0, -np.inf]], np.float32)
    flipped = np.array([[-2.0, -1.0, -np.inf], [-1.0, -3.0, -np.inf]], np.float32)
    acc = compare({"logits": flipped}, {"logits": ref}, {}, Tolerance(cosine_min=0.0), "ref")
    assert acc.outputs[0].top1 == 0.0
