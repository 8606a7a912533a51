"""fuse's ORT fuser in a worker reading the weights from disk (passes/_ort_fuser.py): the same graph and
weights as the in-memory fuser, the input folder and the working directory untouched, failures in one line."""
from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import numpy_helper

from helpers_passes import context, run_model
from optpipe.core.errors import PassError
from optpipe.execution.stage_runner import run_checked
from optpipe.passes import _ort_fuser
from optpipe.passes.export import ExportParams, ExportPass
from optpipe.source.model_source import load_torch_model
from test_fuse import run_fuse, transformer_case
from test_ort_qattention import LAYERS, padded_inputs, tiny_bert_recipe


def tiny_bert_case(tmp_path):
    """A 2-layer BERT, TorchScript export with eager attention: ORT's fuser reads its Q/K/V weights to
    merge them into Attention, the read that must come from disk in the worker."""
    recipe, arrays = tiny_bert_recipe(), padded_inputs()
    ctx = context(recipe, tmp_path / "export", arrays)
    ctx._torch_model = lambda: load_torch_model(recipe.model_source())
    exported = run_checked(ExportPass(ExportParams(exporter="torchscript", opset=17, attention="eager")), None, ctx)
    return exported, recipe, arrays


def _snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def _initializers(artifact):
    return {t.name: numpy_helper.to_array(t) for t in artifact.load().graph.initializer}


@pytest.mark.parametrize("case", [transformer_case, tiny_bert_case])
def test_worker_on_disk_fuses_exactly_as_in_memory(tmp_path, monkeypatch, case):
    source, recipe, arrays = case(tmp_path)
    in_memory = run_fuse(source, recipe, arrays, tmp_path / "memory", transformer="ort", generic=False)
    assert in_memory.info["transformer"]["candidates"]["ort"]["weights"] == "in memory"
    monkeypatch.setattr(_ort_fuser, "WORKER_MIN_BYTES", 0)
    before, cwd = _snapshot(source.folder), os.getcwd()
    on_disk = run_fuse(source, recipe, arrays, tmp_path / "disk", transformer="ort", generic=True)
    assert on_disk.info["transformer"]["candidates"]["ort"]["weights"] == "on disk (worker)"
    assert os.getcwd() == cwd and _snapshot(source.folder) == before  # read only, nothing written beside it
    assert sorted(p.name for p in on_disk.folder.iterdir()) == ["info.json", "model.onnx", "model.onnx.data"]
    assert on_disk.info["transformer"]["candidates"]["ort"]["fused_ops"] == in_memory.info["transformer"]["candidates"]["ort"]["fused_ops"]
    assert in_memory.info["transformer"]["candidates"]["ort"]["fused_ops"], "the case must fuse something"
    if case is tiny_bert_case:
        assert in_memory.info["transformer"]["candidates"]["ort"]["fused_ops"]["Attention"] == LAYERS
    # generic fusions on top may only have added to the graph; compare the transformer step itself
    plain = run_fuse(source, recipe, arrays, tmp_path / "disk-plain", transformer="ort", generic=False)
    assert [n.op_type for n in plain.load().graph.node] == [n.op_type for n in in_memory.load().graph.node]
    ours, theirs = _initializers(plain), _initializers(in_memory)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    np.testing.assert_array_equal(run_model(plain.path, arrays)[0], run_model(in_memory.path, arrays)[0])


def test_worker_failure_is_one_line(tmp_path, monkeypatch):
    """A data file shorter than its tensors: the worker's read fails, and the stage says so in one line."""
    source, recipe, arrays = tiny_bert_case(tmp_path)
    data = source.folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    monkeypatch.setattr(_ort_fuser, "WORKER_MIN_BYTES", 0)
    with pytest.raises(PassError) as raised:
        run_fuse(source, recipe, arrays, tmp_path / "out", transformer="ort", generic=False)
    message = str(raised.value)
    assert "\n" not in message and "ort: " in message and "exceeds" in message, message
