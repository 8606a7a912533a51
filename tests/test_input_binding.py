"""A factory's forward() takes the recipe's inputs by name where they name its parameters (source/module_forms.py,
input_binding). Fed in the recipe's order, [mask, ids] for forward(ids, mask) gave the mask as the token ids: every
stage matched that wrong model, "ok" at cosine 1.0, and a server fed by name got another model than the user's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from family_models import tokens_and_mask

from optpipe.core.errors import ModelSourceError
from optpipe.core.runtime import eager_runner
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.source.model_source import load_torch_model

TESTS = Path(__file__).resolve().parent
DIMS = {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 6, "max": 8}}


def _model(names: list[str], scripted: bool = False):
    inputs = [{"name": name, "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 2] if "mask" in name else [0, 50]}
              for name in names]
    recipe = parse_recipe({"model": {"factory": "family_models:tokens_and_mask", "path": str(TESTS), "kwargs": {"scripted": scripted}},
                           "inputs": inputs, "dims": DIMS, "stages": {"export": {"pass": "export"}}})
    return load_torch_model(recipe.model_source())


def test_inputs_listed_in_another_order_than_forward_are_fed_by_name():
    ids = np.random.default_rng(0).integers(1, 50, (2, 6))
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    out = eager_runner(_model(["mask", "ids"]), threads=1)({"mask": mask, "ids": ids})["output"]
    with torch.no_grad():  # forward(ids, mask) itself
        expected = tokens_and_mask()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(out, expected)
    assert (out[0, 3:] == 0).all()  # padded positions zeroed: the mask was read as the mask


def test_an_input_named_after_a_parameter_at_another_position_is_refused_when_names_cannot_bind():
    with pytest.raises(ModelSourceError, match=r"inputs: 'mask' is parameter 2 of .*forward\(ids, mask\) but input 1"):
        _model(["mask", "tokens"])  # 'tokens' names no parameter: fed in order, the mask would be the ids
    with pytest.raises(ModelSourceError, match="a TorchScript module is exported with its inputs in the recipe's order"):
        _model(["mask", "ids"], scripted=True)
    assert _model(["ids", "mask"], scripted=True).input_names == ["ids", "mask"]  # in forward's order: as it is


KEYWORD_ONLY = '''import torch


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, *, x):  # keyword-only: it takes no position
        return self.fc(x)


def scaled():
    torch.manual_seed(0)
    return Scaled().eval()
'''


def test_a_keyword_only_forward_is_fed_by_name_by_init_and_the_compile(tmp_path, cli_run, monkeypatch):
    # forward(self, *, x): init inferred x [batch, 16] and refused it ("takes 1 positional argument but 2 were given"),
    # and a recipe written by hand failed the same way: in forward()'s order, the input was fed by position.
    (tmp_path / "kwonly_model.py").write_text(KEYWORD_ONLY)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "kwonly_model:scaled", "-o", "scaled.yaml")
    assert result.exit_code == 0, result.output
    recipe = parse_recipe({"model": {"factory": "kwonly_model:scaled", "path": str(tmp_path)},
                           "inputs": [{"name": "x", "shape": ["batch", 16]}], "dims": {"batch": {"min": 1, "opt": 2, "max": 4}},
                           "stages": {"export": {"pass": "export"}}})
    x = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)
    out = eager_runner(load_torch_model(recipe.model_source()), threads=1)({"x": x})["output"]
    assert out.shape == (2, 4)
