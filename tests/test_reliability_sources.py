"""Broken PyTorch sources are the user's input: one line naming what to change, exit code 2
(never 1, "a stage failed"), no traceback, and no stage published to the cache for them.

A real bug inside a pass is still exit 1, "internal error" naming the stage's log. The error's
kind crosses every boundary a stage runs behind: this process, the worker of a stage with
`timeout_s`, and the fan-out executors' results (pickled for Ray).
"""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
from reliability_fixtures import onnx_recipe, run_main, write_recipe

NETS = '''
import torch


class Meta:
    """Not a tensor: a checkpoint holding one is a pickle that could run code."""


class MLP(torch.nn.Module):
    output_names = ["y"]

    def __init__(self, in_dim):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_dim, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class BatchOne(MLP):
    def forward(self, x):  # right at batch 1 (as loading tries it), wrong at any other batch
        return super().forward(x.reshape(1, -1))


def mlp(in_dim=16):
    torch.manual_seed(0)
    return MLP(in_dim)


def batch_one():
    return BatchOne(16)
'''


def _module(folder: Path) -> str:
    """The factory module's name: one per folder, since Python keeps an imported module for the session."""
    return "srcnets_" + hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:12]


def _factory(folder: Path, factory: str = "mlp", inputs: list | None = None, **model) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{_module(folder)}.py").write_text(NETS)
    recipe = onnx_recipe(folder)
    recipe["inputs"] = inputs or recipe["inputs"]
    recipe["model"] = {"factory": f"{_module(folder)}:{factory}", "path": ".", **model}
    return ["compile", str(write_recipe(folder, recipe))]


def _checkpoint(folder: Path, write, name: str = "weights.pt") -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    write(folder / name)
    return _factory(folder, checkpoint=name)


def _state(in_dim: int = 16) -> dict:
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(in_dim, 8))
    net.add_module("fc2", torch.nn.Linear(8, 4))
    return net.state_dict()


def _truncated(path: Path) -> None:
    import torch

    torch.save(_state(), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _with_object(path: Path) -> None:
    import importlib
    import sys

    import torch

    (path.parent / f"{_module(path.parent)}.py").write_text(NETS)
    sys.path.insert(0, str(path.parent))
    try:
        nets = importlib.import_module(_module(path.parent))
        torch.save({**_state(), "meta": nets.Meta()}, path)
    finally:
        sys.path.remove(str(path.parent))


def _hf(folder: Path, config_text: str | None = None, weights: bool = False) -> list[str]:
    """A Hugging Face folder: a tiny BERT config, its text replaced by `config_text`, with or without weights."""
    import transformers

    model = folder / "bert"
    config = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=32)
    if weights:
        transformers.BertModel(config).save_pretrained(model)
    else:
        config.save_pretrained(model)
    if config_text is not None:
        (model / "config.json").write_text(config_text)
    recipe = onnx_recipe(folder)
    recipe["model"] = {"hf": "bert"}
    recipe["inputs"] = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 8], "range": [0, 50]}]
    return ["compile", str(write_recipe(folder, recipe))]


def _export_params(folder: Path, **params) -> list[str]:
    """A factory model whose export stage asks for what it cannot have: the recipe's to change."""
    args = _factory(folder)
    recipe = Path(args[1])
    text = recipe.read_text().replace("pass: export", "pass: export\n    params: " + json.dumps(params))
    recipe.write_text(text)
    return args


INT_X = [{"name": "x", "dtype": "int64", "shape": ["batch", 16], "range": [0, 10]}]
TWO = [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}, {"name": "mask", "dtype": "float32", "shape": ["batch", 16]}]

# name -> (builder, words the one error line must hold)
SOURCES = {
    "checkpoint of another width": (lambda d: _checkpoint(d, lambda p: __import__("torch").save(_state(12), p)),
                                    "does not fit the factory's module"),
    "checkpoint is a text file": (lambda d: _checkpoint(d, lambda p: p.write_text("these are not weights\n")),
                                  "'weights.pt' is not a readable torch checkpoint"),
    "checkpoint is a note": (lambda d: _checkpoint(d, lambda p: p.write_text("not weights\n")),
                             "(Unsupported operand 110: not a torch.save file, or a damaged one)"),
    "checkpoint truncated": (lambda d: _checkpoint(d, _truncated), "'weights.pt' is not a readable torch checkpoint"),
    "checkpoint holds an object": (lambda d: _checkpoint(d, _with_object), "set `model.allow_pickle: true`"),
    "safetensors of garbage": (lambda d: _checkpoint(d, lambda p: p.write_bytes(b"\x07" * 64), "w.safetensors"),
                               "'w.safetensors' is not a valid safetensors file"),
    "forward on the wrong width": (lambda d: _factory(d, inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 12]}]),
                                   "the PyTorch model fails on the recipe's inputs (x [1, 12] float32)"),
    "forward given two inputs": (lambda d: _factory(d, inputs=TWO), "fails on the recipe's inputs (x [1, 16] float32, mask"),
    "forward on the wrong dtype": (lambda d: _factory(d, inputs=INT_X), "fails on the recipe's inputs (x [1, 16] int64)"),
    "forward only at batch 1": (lambda d: _factory(d, "batch_one"), "fails on the recipe's inputs (x [2, 16] float32)"),
    "hf config.json broken": (lambda d: _hf(d, config_text="{ not json"), "model: cannot load"),
    "hf weights missing": (lambda d: _hf(d), "no file named model.safetensors"),
    # export params the model cannot have
    "hf attention on a factory model": (lambda d: _export_params(d, attention="eager"), "`attention` applies to Hugging Face models only"),
    # `exporter: dynamo` below opset 18 is refused with the recipe, before any stage (test_core_passes.py)
}


def _stage_entries(cache: Path) -> list[Path]:
    return [p for p in (cache / "stages").iterdir() if not p.name.startswith(".")] if (cache / "stages").is_dir() else []


def _one_error(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err, err
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("case", list(SOURCES))
def test_a_broken_pytorch_source_is_the_users_to_fix(case, tmp_path, monkeypatch, capsys):
    build, words = SOURCES[case]
    monkeypatch.delenv("OPTPIPE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(build(tmp_path), capsys)
    line = _one_error(err)
    assert words in line, line
    assert "internal error" not in line and "(log:" not in line, line
    assert code == 2, (code, err)
    assert _stage_entries(tmp_path / "cache") == []  # nothing published for a source that does not work
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    export = next(s for s in report["stages"] if s["name"] == "export")
    assert (export["status"], export["error_kind"]) == ("failed", "input")


def test_the_eager_baseline_meeting_the_same_source_adds_no_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = _factory(tmp_path, inputs=INT_X)
    recipe = Path(args[1])
    recipe.write_text(recipe.read_text().replace("eager_baseline: false", "eager_baseline: true"))
    code, out, err = run_main(args, capsys)
    assert "fails on the recipe's inputs" in _one_error(err)
    assert code == 2
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert stages["pytorch-eager"]["error_kind"] == "input"


def test_the_kind_crosses_the_worker_process_of_a_stage_with_a_time_limit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = _checkpoint(tmp_path, lambda p: p.write_text("not weights"))
    recipe = Path(args[1])
    recipe.write_text(recipe.read_text().replace("pass: export", "pass: export\n    timeout_s: 120"))
    code, out, err = run_main(args, capsys)
    assert "is not a readable torch checkpoint" in _one_error(err)
    assert code == 2, err
    assert _stage_entries(tmp_path / "cache") == []


def test_the_fan_out_path_exits_2_too(tmp_path, monkeypatch, capsys):
    """Two recipes go through the fan-out executor (the Ray executor's driver side): same kind, same code."""
    monkeypatch.chdir(tmp_path)
    first = _factory(tmp_path / "a", inputs=INT_X)
    second = _checkpoint(tmp_path / "b", lambda p: p.write_text("not weights"))
    code, out, err = run_main(["compile", first[1], second[1]], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 2, err
    assert code == 2, err


def test_an_input_error_beside_a_stage_failure_exits_1():
    """Something beyond the input broke as well: exit 1, and both lines."""
    from optpipe.cli.failures import failure_lines
    from optpipe.core.results import StageResult

    bad_source = StageResult(name="export", pass_name="export", status="failed", reason="model.checkpoint: x", error_kind="input")
    broken = StageResult(name="int8", pass_name="int8", status="failed", reason="quantizer failed (log: l)", error_kind="stage")
    assert failure_lines([bad_source], [])[1] == 2
    eager = StageResult(name="pytorch-eager", pass_name="eager", status="failed", reason="model.checkpoint: x", error_kind="input")
    assert failure_lines([eager, bad_source], []) == (["error: stage 'export' failed: model.checkpoint: x"], 2)
    lines, code = failure_lines([bad_source, broken], [])
    assert code == 1 and len(lines) == 2


def test_the_kind_survives_pickling_for_ray():
    """Ray pickles a task's StageResult back to the driver."""
    import cloudpickle

    from optpipe.core.results import StageResult

    result = StageResult(name="export", pass_name="export", status="failed", reason="r", error_kind="input")
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        assert loads(dumps(result)).error_kind == "input"


def test_a_bug_inside_a_pass_is_still_an_internal_error_exit_1(tmp_path, monkeypatch, capsys):
    """Not the user's input: a bug in optpipe (here one injected into export's graph statistics)."""
    import optpipe.passes.export as export

    def broken_stats(model):
        raise KeyError("a bug")

    monkeypatch.setattr(export, "graph_stats", broken_stats)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(_factory(tmp_path), capsys)
    line = _one_error(err)
    assert "internal error in pass 'export' (KeyError" in line and "(log: " in line, line
    assert code == 1
    assert _stage_entries(tmp_path / "cache") == []


@pytest.mark.parametrize("timeout_s", [None, 60], ids=["in this process", "in a worker process"])
def test_a_bug_inside_a_plugin_pass_is_internal_wherever_it_runs(timeout_s, tmp_path, monkeypatch, capsys):
    import os

    from reliability_fixtures import HERE, PLUGIN, write_linear_onnx

    from optpipe.passes import registry

    monkeypatch.setenv("OPTPIPE_PLUGINS", PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    registry.cache_clear()
    monkeypatch.chdir(tmp_path)
    write_linear_onnx(tmp_path / "model")
    bad = {"pass": "buggy", "after": "export", **({"timeout_s": timeout_s} if timeout_s else {})}
    try:
        code, out, err = run_main(["compile", str(write_recipe(tmp_path, onnx_recipe(tmp_path, stages={"export": {"pass": "export"}, "bad": bad})))], capsys)
    finally:
        registry.cache_clear()
    line = _one_error(err)
    assert "stage 'bad' failed: internal error in pass 'buggy' (KeyError" in line and "(log: " in line, line
    assert code == 1
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert stages["bad"]["error_kind"] == "internal" and stages["export"]["status"] == "ok"
