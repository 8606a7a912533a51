"""Guards on what a recipe points at: checkpoints (no code from pickles), the >2 GB code path,
and --allow-path."""
from __future__ import annotations

import pickle

import onnx
import pytest
import torch
from reliability_fixtures import onnx_recipe, tiny_torch, write_linear_onnx, write_recipe

from optpipe.safety import onnx_guard
from optpipe.safety.checkpoints import load_checkpoint
from optpipe.core.errors import ModelSourceError, RecipeError
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe, parse_recipe


class TrustedExtra:
    """An object beyond tensors in a checkpoint (pickled by its import path)."""


def test_checkpoints_load_as_tensors_only_unless_the_recipe_opts_in(tmp_path):
    from safetensors.torch import save_file

    source = tiny_torch()
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    target = tiny_torch()
    torch.nn.init.zeros_(target.fc1.weight)
    load_checkpoint(target, tmp_path / "w.safetensors", allow_pickle=False)
    assert torch.equal(target.fc1.weight, source.fc1.weight)

    torch.save({"state_dict": source.state_dict(), "extra": TrustedExtra()}, tmp_path / "w.pt")
    with pytest.raises(ModelSourceError, match="allow_pickle: true"):
        load_checkpoint(tiny_torch(), tmp_path / "w.pt", allow_pickle=False)
    load_checkpoint(target, tmp_path / "w.pt", allow_pickle=True)  # the recipe's explicit opt-in
    torch.save(source.state_dict(), tmp_path / "plain.pt")  # tensors only: fine without the opt-in
    load_checkpoint(target, tmp_path / "plain.pt", allow_pickle=False)
    (tmp_path / "bad.pt").write_bytes(pickle.dumps("not a state dict")[:5])
    with pytest.raises(ModelSourceError, match="not a readable torch checkpoint"):
        load_checkpoint(target, tmp_path / "bad.pt", allow_pickle=False)


def test_models_are_checked_by_path_with_the_full_check(tmp_path, monkeypatch):
    """By path, so a model over 2 GB is never serialized whole (and no model's weights are loaded)."""
    path = write_linear_onnx(tmp_path)
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda model, **kw: (seen.append((model, kw)), real(model, **kw)))
    onnx_guard.check_model_file(path, "model.onnx")
    assert seen == [(str(path), {"full_check": True})]


def test_the_costly_source_checks_run_once_per_version_of_the_file(tmp_path, monkeypatch):
    """An ORT session reads every weight (seconds for gigabytes): a rerun on the same file skips it,
    and a file replaced by one ORT cannot load is refused again, before any stage."""
    from reliability_fixtures import write_custom_op_onnx

    write_linear_onnx(tmp_path / "model")
    recipe = parse_recipe(onnx_recipe(tmp_path, stages={"export": {"pass": "export"}}), base_dir=tmp_path)
    sessions = []
    real = onnx_guard.check_runnable
    monkeypatch.setattr(onnx_guard, "check_runnable", lambda path, where: (sessions.append(path), real(path, where)))
    compile_recipe(recipe, RunOptions())
    compile_recipe(recipe, RunOptions())
    assert len(sessions) == 1
    (tmp_path / "model" / "model.onnx.data").unlink()
    write_custom_op_onnx(tmp_path / "model", "com.example")  # same inputs, an op ONNX Runtime has no kernel for
    with pytest.raises(ModelSourceError, match="ONNX Runtime cannot run op 'FrobnicateTensor'"):
        compile_recipe(recipe, RunOptions())
    assert len(sessions) == 2


def test_a_large_model_goes_through_every_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_guard, "PROTOBUF_LIMIT", 1)
    write_linear_onnx(tmp_path / "model")
    stages = {
        "export": {"pass": "export"},
        "simplify": {"pass": "simplify", "after": "export"},
        "onnxsim": {"pass": "simplify", "after": "export", "params": {"backend": "onnxsim"}},
    }
    recipe = parse_recipe(onnx_recipe(tmp_path, stages=stages), base_dir=tmp_path)
    report = compile_recipe(recipe, RunOptions())
    status = {s.name: (s.status, s.reason) for s in report.stages}
    assert status["export"][0] == status["simplify"][0] == "ok"
    assert status["onnxsim"][0] == "failed" and "use `backend: onnxslim`" in status["onnxsim"][1]
    assert report.stage("simplify").accuracy.within_tolerance


def test_allow_path_lets_a_recipe_name_a_folder_outside(tmp_path, monkeypatch):
    project, models = tmp_path / "project", tmp_path / "models"
    write_linear_onnx(models)
    recipe = write_recipe(project, onnx_recipe(project, model=str(models / "model.onnx")))
    monkeypatch.chdir(project)
    with pytest.raises(RecipeError, match="outside the recipe's folder"):
        load_recipe(recipe)
    assert load_recipe(recipe, allow_paths=(models,)).model.onnx == str(models / "model.onnx")


def test_a_python_built_recipe_is_trusted_with_its_paths_but_not_its_names(tmp_path):
    data = onnx_recipe(tmp_path, model="/somewhere/else/model.onnx")
    parse_recipe(data, base_dir=tmp_path)  # code, not a downloaded file: paths are its author's business
    data["stages"]["../escape"] = {"pass": "simplify", "after": "export"}
    with pytest.raises(RecipeError, match="not a plain name"):
        parse_recipe(data, base_dir=tmp_path)
