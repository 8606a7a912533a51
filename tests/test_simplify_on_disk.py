"""simplify's onnxslim in a worker reading the large weights from disk (passes/_onnxslim_on_disk.py): the
same graph, weights and outputs as onnxslim on the loaded model, the input folder and the working directory
untouched, and a worker that fails falls back to the in-memory path, saying so."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from helpers_passes import context, graph_recipe, run_model
from optpipe.core.artifact import ModelArtifact, save_model
from optpipe.core.errors import PassError
from optpipe.execution.stage_runner import run_checked
from optpipe.passes import _onnxslim_on_disk
from optpipe.passes.simplify import SimplifyPass, SimplifyParams
from test_fuse_on_disk import _initializers, _snapshot, tiny_bert_case


class _WideConvNet(nn.Module):
    """Conv-BN blocks whose weights (2.4 MB) are over the worker's in-memory bound, a MatMul by a constant
    onnxslim can fold, and a classifier head: the weights must travel through onnxslim from disk."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.b1 = nn.Conv2d(3, 256, 3, padding=1), nn.BatchNorm2d(256)
        self.c2, self.b2 = nn.Conv2d(256, 256, 3, padding=1), nn.BatchNorm2d(256)
        self.fc = nn.Linear(256, 1000)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 1000))  # a Mul by a constant: onnxslim reads its values
        for norm in (self.b1, self.b2):  # not the identity, so that a fold of the wrong bytes shows
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)

    def forward(self, x):
        y = torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
        return self.fc(y.mean((2, 3)) @ (torch.ones(256, 256) * 0.01)) * self.scale


def conv_case(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    torch.onnx.export(_WideConvNet().eval(), (torch.randn(1, 3, 16, 16),), str(folder / "raw.onnx"), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "N"}}, dynamo=False)
    source = save_model(onnx.load(str(folder / "raw.onnx")), tmp_path / "in")
    recipe = graph_recipe([{"name": "x", "shape": ["N", 3, 16, 16]}], dims={"N": {"min": 1, "opt": 2, "max": 4}})
    return source, recipe, {"x": np.random.default_rng(0).normal(size=(4, 3, 16, 16)).astype(np.float32)}


def fold_case(tmp_path):
    """Transpose and Mul of a 2 MB weight, which onnxslim folds into one constant: the fold reads the
    weight's bytes from disk (through ORT, in the worker's folder) and writes a new constant."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(size=(1024, 512)).astype(np.float32), "W"),
               numpy_helper.from_array(rng.normal(size=(1024,)).astype(np.float32), "bias"),
               numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("Mul", ["Wt", "two"], ["Wt2"]),
             helper.make_node("MatMul", ["x", "Wt2"], ["h"]), helper.make_node("Add", ["h", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1024])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    recipe = graph_recipe([{"name": "x", "shape": ["N", 512]}], dims={"N": {"min": 1, "opt": 2, "max": 4}})
    return save_model(model, tmp_path / "in"), recipe, {"x": rng.normal(size=(4, 512)).astype(np.float32)}


def _simplify(source, recipe, arrays, workdir) -> ModelArtifact:
    return run_checked(SimplifyPass(SimplifyParams()), ModelArtifact.open(source.folder), context(recipe, workdir, arrays))


@pytest.mark.parametrize("case", [conv_case, fold_case, tiny_bert_case])
def test_onnxslim_on_disk_simplifies_exactly_as_in_memory(tmp_path, monkeypatch, case):
    source, recipe, arrays = case(tmp_path)
    # the tiny BERT's matrices are 16 KB: a lower bound leaves them on disk too
    monkeypatch.setattr(_onnxslim_on_disk, "SHAPE_TENSOR_BYTES", 4096 if case is tiny_bert_case else 1 << 20)
    in_memory = _simplify(source, recipe, arrays, tmp_path / "memory")
    assert in_memory.info["weights"] == "in memory"
    monkeypatch.setattr(_onnxslim_on_disk, "WORKER_MIN_BYTES", 0)
    # A decoy where optpipe runs: the worker resolves locations in the model's folder, never here.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.onnx.data").write_bytes(b"\x7f" * 64)
    before, cwd = _snapshot(source.folder), os.getcwd()
    on_disk = _simplify(source, recipe, arrays, tmp_path / "disk")
    assert on_disk.info["weights"] == "on disk (worker)" and on_disk.info["shape_inference"] == "graph-only"
    assert os.getcwd() == cwd and _snapshot(source.folder) == before  # read only, nothing written beside it
    assert sorted(p.name for p in on_disk.folder.iterdir()) == ["info.json", "model.onnx", "model.onnx.data"]
    held_out = [t for t in source.load(with_weights=False).graph.initializer
                if onnx.external_data_helper.uses_external_data(t) and np.prod(t.dims) * 4 >= _onnxslim_on_disk.SHAPE_TENSOR_BYTES]
    assert held_out, "the case must have weights the worker leaves on disk"
    assert [n.op_type for n in on_disk.load().graph.node] == [n.op_type for n in in_memory.load().graph.node]
    assert on_disk.info["nodes_after"] == in_memory.info["nodes_after"]
    if case is fold_case:
        assert [n.op_type for n in on_disk.load().graph.node] == ["MatMul", "Add"]  # the weight's arithmetic folded
    ours, theirs = _initializers(on_disk), _initializers(in_memory)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    np.testing.assert_array_equal(run_model(on_disk.path, arrays)[0], run_model(in_memory.path, arrays)[0])
    assert on_disk.info["self_check"]["passed"]


def test_a_worker_that_fails_falls_back_to_the_loaded_model_and_says_why(tmp_path, monkeypatch):
    """Every weight left on disk (bound 0): onnxslim's graphsurgeon exports a constant it read as raw data still
    marked external, which onnx refuses in its next iteration; the stage still simplifies, in memory."""
    source, recipe, arrays = conv_case(tmp_path)
    monkeypatch.setattr(_onnxslim_on_disk, "WORKER_MIN_BYTES", 0)
    monkeypatch.setattr(_onnxslim_on_disk, "SHAPE_TENSOR_BYTES", 0)
    out = _simplify(source, recipe, arrays, tmp_path / "out")
    assert out.info["weights"] == "in memory"
    failure = out.info["on_disk_failed"]
    assert "\n" not in failure and "external" in failure.lower(), failure
    assert out.info["nodes_after"] < out.info["nodes_before"] and out.info["self_check"]["passed"]
    assert sorted(p.name for p in out.folder.iterdir()) == ["info.json", "model.onnx", "model.onnx.data"]


def test_unreadable_weights_fail_in_one_line_after_the_fallback(tmp_path, monkeypatch):
    """A data file shorter than its tensors: both paths fail, and the stage says so in one line."""
    source, recipe, arrays = conv_case(tmp_path)
    data = source.folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    monkeypatch.setattr(_onnxslim_on_disk, "WORKER_MIN_BYTES", 0)
    with pytest.raises(PassError) as raised:
        _simplify(source, recipe, arrays, tmp_path / "out")
    message = str(raised.value)
    assert "\n" not in message and "cannot read the input model" in message and "exceeds" in message, message
