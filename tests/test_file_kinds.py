"""A model file of another format given as ONNX (or to init), or a Hub id given as a folder, is named with the
recipe that takes it (optpipe/safety/file_kinds.py); it was "not an ONNX model or is truncated; export it again"."""
from __future__ import annotations

import json
import struct

import pytest

from optpipe.core.errors import ModelSourceError
from optpipe.safety.onnx_guard import load_graph


def _torch_save(path):
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Linear(4, 2).state_dict(), path)


def _safetensors(path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)


def _torchscript(path):
    torch = pytest.importorskip("torch")
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 2)), path)


def _npz(path):
    import numpy as np

    with path.open("wb") as handle:
        np.savez(handle, x=np.zeros(2))


FILES = {
    "ckpt.pt": (_torch_save, "a PyTorch checkpoint \\(torch.save\\); use `model: {factory"),
    "scripted.pt": (_torchscript, "a TorchScript archive; use `model: {torchscript: FILE}`"),
    "arrays.npz": (_npz, "a NumPy .npz of arrays: data, not a model"),
    "cut.pt": (lambda p: (_torchscript(p), p.write_bytes(p.read_bytes()[:200])), "a zip archive cut short or damaged"),
    "weights.safetensors": (_safetensors, "safetensors weights"),
    "model.gguf": (lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 32), "a GGUF checkpoint; scripts/gguf_to_hf.py"),
    "model.tflite": (lambda p: p.write_bytes(b"\x1c\x00\x00\x00TFL3" + b"\0" * 32), "a TensorFlow Lite model"),
    "model.h5": (lambda p: p.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 32), "a Keras HDF5 model"),
    "model.xml": (lambda p: p.write_text('<?xml version="1.0"?>\n<net name="m" version="11">\n'), "an OpenVINO IR"),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_model_of_another_format_is_named_with_what_to_give(tmp_path, name):
    write, said = FILES[name]
    path = tmp_path / name
    write(path)
    with pytest.raises(ModelSourceError, match=f"'{name}' is not ONNX: it is {said}"):
        load_graph(path, "model.onnx")


def test_a_checkpoint_named_onnx_is_named_too_and_a_broken_onnx_is_still_broken(tmp_path):
    _torch_save(tmp_path / "model.onnx")
    with pytest.raises(ModelSourceError, match="is not ONNX: it is a PyTorch checkpoint.*factory"):
        load_graph(tmp_path / "model.onnx", "model.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"\x08\x07\x12\xff\xff")
    with pytest.raises(ModelSourceError, match="is not an ONNX model or is truncated"):
        load_graph(tmp_path / "broken.onnx", "model.onnx")


def test_init_names_the_format_and_a_config_json_for_its_folder(tmp_path, cli_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _safetensors(tmp_path / "weights.safetensors")
    result = cli_run("init", "weights.safetensors", "-o", "recipe.yaml")
    assert result.exit_code == 2 and "is safetensors weights; give the Hugging Face folder" in result.output, result.output
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text("{}")
    result = cli_run("init", "bert/config.json", "-o", "recipe.yaml")
    assert result.exit_code == 2 and "config.json; give its folder" in result.output, result.output


def test_a_hub_id_is_answered_with_how_to_get_the_folder(tmp_path, cli_run, monkeypatch):
    """`hf: google-bert/bert-base-uncased`, as a model card shows it, is no folder here and optpipe downloads nothing:
    compile and init say how to fetch it, where they said 'does not exist' (with a GGUF hint) or 'not a folder'."""
    from helpers_recipes import compile_recipe, small_recipe

    monkeypatch.chdir(tmp_path)
    tokens = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 8], "range": [0, 100]}]
    result = compile_recipe(tmp_path, cli_run, small_recipe({"hf": "google-bert/bert-base-uncased"}, tokens))
    assert result.exit_code == 2, result.output
    assert "if 'google-bert/bert-base-uncased' is a Hugging Face Hub id: optpipe loads nothing from a hub" in result.output
    assert "huggingface-cli download google-bert/bert-base-uncased --local-dir DIR" in result.output
    assert "scripts/gguf_to_hf.py" in result.output  # the other cause stays named: it may be a folder not written yet
    result = cli_run("init", "google-bert/bert-base-uncased", "-o", "recipe.yaml")
    assert result.exit_code == 2 and "is a Hugging Face Hub id" in result.output, result.output
    (tmp_path / "models" / "mine").mkdir(parents=True)  # an existing relative folder is never taken for an id
    assert "Hub id" not in cli_run("init", "models/mine", "-o", "recipe.yaml").output


def test_a_torchscript_archive_is_a_model_source_of_its_own(tmp_path, cli_run, monkeypatch):
    """A TorchScript file was "a PyTorch checkpoint ...; use a factory + checkpoint": it holds no weights for a
    factory's module, it is the module. `model: {torchscript: FILE}` compiles it, and init writes that recipe."""
    import yaml

    _torchscript(tmp_path / "scripted.pt")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "scripted.pt", "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert recipe["model"] == {"torchscript": "scripted.pt"}
    assert recipe["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]  # from its first layer
    recipe["data"] = {"eval": {"source": "synthetic", "samples": 4}, "calibration": {"source": "synthetic", "samples": 4}}
    recipe["stages"] = {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli_run("compile", "recipe.yaml")
    assert result.exit_code == 0, result.output
    report = yaml.safe_load((tmp_path / recipe["output"] / "report.json").read_text())
    rows = {row["name"]: row for row in report["stages"]}
    assert rows["export"]["info"]["exporter"] == "torchscript" and rows["pytorch-eager"]["verdict"] == "ok"
    _torch_save(tmp_path / "weights.pt")
    recipe["model"] = {"torchscript": "weights.pt"}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli_run("compile", "recipe.yaml")
    assert result.exit_code == 2 and "'weights.pt' is not a TorchScript archive: it is a PyTorch checkpoint" in result.output
