"""A stage's model is saved into its own folder whatever the working directory holds: onnx checks
that the external-data file does not exist relative to the working directory, so a user's own
model.onnx.data where optpipe ran made every pass fail ('External data file exists')."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from optpipe.core.artifact import DATA_FILE, save_model


def test_a_data_file_in_the_working_directory_is_not_the_stage_s(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / DATA_FILE).write_bytes(b"the user's own weights")
    weight = numpy_helper.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "W")
    bias = numpy_helper.from_array(np.ones(4, np.float32), "b")  # under the 1 KiB threshold: stays inline
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])], [weight, bias])
    artifact = save_model(helper.make_model(graph), tmp_path / "stage")

    assert (tmp_path / DATA_FILE).read_bytes() == b"the user's own weights"  # untouched
    stored = onnx.load(str(artifact.path), load_external_data=False)
    locations = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in stored.graph.initializer}
    assert locations == {"W": DATA_FILE, "b": None}
    loaded = onnx.load(str(artifact.path))
    assert np.array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), numpy_helper.to_array(weight))
