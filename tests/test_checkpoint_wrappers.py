"""A factory's checkpoint as training scripts save it (optpipe/safety/checkpoints.py): keys behind a wrapper's
prefix (DataParallel's `module.`, torch.compile's `_orig_mod.`, a Lightning module's `model.`), or a whole module
saved with torch.save(model). Each was refused as "does not fit the factory's module" / "holds a Net"."""
from __future__ import annotations

import pytest
import torch

from optpipe.core.errors import ModelSourceError
from optpipe.safety.checkpoints import load_checkpoint


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _loaded(tmp_path, saved, allow_pickle=False) -> torch.nn.Module:
    torch.save(saved, tmp_path / "ckpt.pt")
    net = _net()
    load_checkpoint(net, tmp_path / "ckpt.pt", allow_pickle)
    return net


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "model.", "module._orig_mod."])
def test_a_training_wrappers_prefix_is_dropped_where_every_key_then_fits(tmp_path, prefix):
    trained = _net()
    state = {prefix + key: value for key, value in trained.state_dict().items()}
    net = _loaded(tmp_path, {"state_dict": state, "epoch": 3})
    assert all(torch.equal(value, trained.state_dict()[key]) for key, value in net.state_dict().items())


def test_a_prefix_that_leaves_keys_unmatched_is_still_refused_naming_them(tmp_path):
    state = {"module." + key: value for key, value in _net().state_dict().items() if key != "2.bias"}
    with pytest.raises(ModelSourceError, match="does not fit the factory's module .*2.bias"):
        _loaded(tmp_path, state)
    with pytest.raises(ModelSourceError, match="does not fit the factory's module"):  # an empty one: no prefix to drop
        _loaded(tmp_path, {})


def test_a_whole_module_saved_is_read_for_its_weights_when_pickles_are_allowed(tmp_path):
    trained = _net()
    net = _loaded(tmp_path, trained, allow_pickle=True)
    assert all(torch.equal(value, trained.state_dict()[key]) for key, value in net.state_dict().items())
    with pytest.raises(ModelSourceError, match="allow_pickle: true"):
        _loaded(tmp_path, trained)
