"""adopt_model: an ONNX file whose weights sit in one external data file beside it (what torch.onnx's
dynamo export writes) becomes an artifact by a rename and a graph-only rewrite, not a load and a save
of its weights; any other layout goes through save_model, so every artifact keeps model.onnx.data."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from optpipe.core.artifact import DATA_FILE, MODEL_FILE, adopt_model

X = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)


def _model(big_bias: bool = False) -> onnx.ModelProto:
    """Two 16 KiB weights and a bias: of 64 floats (256 B, inline under any threshold) or of 4096 (16 KiB)."""
    rng = np.random.default_rng(1)
    tensors = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), name) for name in ("W1", "W2")]
    bias = numpy_helper.from_array(rng.standard_normal((64, 64) if big_bias else (64,)).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y0"]),
             helper.make_node("Add", ["y0", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [64 if big_bias else 1, 64])],
                              [*tensors, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _write(model: onnx.ModelProto, folder, locations: dict[str, str]):
    """`model` into `folder/exported.onnx`, each named tensor external in its own file name."""
    folder.mkdir()
    offsets: dict[str, int] = {}
    for tensor in model.graph.initializer:
        if tensor.name in locations:
            location = locations[tensor.name]
            data = tensor.raw_data
            with open(folder / location, "ab") as fh:
                fh.write(data)
            onnx.external_data_helper.set_external_data(tensor, location, offset=offsets.get(location, 0), length=len(data))
            offsets[location] = offsets.get(location, 0) + len(data)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save_model(model, str(folder / "exported.onnx"))
    return folder / "exported.onnx"


def _run(path) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def _locations(path) -> set:
    stored = onnx.load(str(path), load_external_data=False)
    return {next((e.value for e in t.external_data if e.key == "location"), None) for t in stored.graph.initializer}


def _largest_inline(path) -> int:
    stored = onnx.load(str(path), load_external_data=False)
    return max((len(t.raw_data) for t in stored.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL), default=0)


def test_one_data_file_is_renamed_into_the_artifact(tmp_path):
    source = _write(_model(), tmp_path / "raw", {"W1": "weights.bin", "W2": "weights.bin"})
    expected = _run(source)
    artifact = adopt_model(source, tmp_path / "stage")
    assert not (tmp_path / "raw" / "weights.bin").exists()  # moved, not copied
    assert _locations(artifact.path) == {DATA_FILE, None}  # the small tensors stay inline, as the writer put them
    assert (tmp_path / "stage" / DATA_FILE).stat().st_size == 2 * 64 * 64 * 4
    np.testing.assert_array_equal(_run(artifact.path), expected)


def test_other_layouts_are_saved_the_usual_way(tmp_path):
    for name, model, locations in [("two-files", _model(), {"W1": "a.bin", "W2": "b.bin"}),
                                   ("inline", _model(big_bias=True), {"W1": "a.bin", "W2": "a.bin"}),
                                   ("all-inline", _model(), {})]:
        source = _write(model, tmp_path / name, locations)
        expected = _run(source)
        artifact = adopt_model(source, tmp_path / f"{name}-stage")
        assert sorted(p.name for p in artifact.folder.iterdir() if p.suffix != ".json") == [MODEL_FILE, DATA_FILE], name
        assert DATA_FILE in _locations(artifact.path) and _largest_inline(artifact.path) < 1024, name  # save_model's layout
        np.testing.assert_array_equal(_run(artifact.path), expected)
        assert all((tmp_path / name / location).exists() for location in locations.values()), name  # copied: source intact
