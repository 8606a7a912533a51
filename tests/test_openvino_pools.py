"""A pooling window that covers its whole input (Hugging Face EfficientNet's `AvgPool2d(hidden_dim,
ceil_mode=True)`): OpenVINO's ONNX frontend refuses it; the OpenVINO passes convert it as the global pooling
it computes, say so in the stage's info, and give the same outputs as ONNX Runtime on the original."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.execution.stage_runner import run_checked
from optpipe.graph.global_pools import whole_input_pools_as_global
from optpipe.passes import get_pass


def pooled(kernel=64, strides=64, ceil_mode=1, spatial=(8, 8), op="AveragePool", **attrs) -> onnx.ModelProto:
    """x [batch, 4, H, W] -> Conv (stride 4: a 2 x 2 map at 8 x 8) -> a pool with the given window."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(8, 4, 3, 3)).astype(np.float32), "w")  # 1152 B: external data
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", strides=[4, 4], pads=[1, 1, 1, 1]),
             helper.make_node(op, ["c"], ["y"], name="pool", kernel_shape=[kernel, kernel], strides=[strides, strides],
                              ceil_mode=ceil_mode, **attrs)]
    graph = helper.make_graph(nodes, "pooled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, *spatial])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, None, None])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


def test_a_window_over_the_whole_input_converts_as_global_pooling(tmp_path):
    from optpipe.evaluation import openvino_runtime as ovr

    source = artifact_of(pooled(), tmp_path / "source")
    with pytest.raises(Exception) as refused:  # what the passes met before: every HF EfficientNet's OpenVINO stages failed
        ovr.read_onnx(source.path)
    assert "larger than the data shape" in ovr.conversion_failure(refused.value)  # the cause, in the one line
    recipe = graph_recipe([{"name": "x", "shape": ["batch", 4, 8, 8]}], {"batch": {"min": 1, "opt": 1, "max": 4}})
    feeds = {"x": np.random.default_rng(1).normal(size=(8, 4, 8, 8)).astype(np.float32)}
    reference = run_model(source.path, feeds)[0]
    assert reference.shape == (8, 8, 1, 1)
    np.testing.assert_allclose(reference, run_model(source.path, feeds)[0])
    cls = get_pass("openvino")
    out = run_checked(cls(cls.Params(precision="fp32")), source, context(recipe, tmp_path / "ov", feeds))
    assert out.info["rewritten_for_openvino"] == {"global_pooling": ["pool"]}
    assert out.info["check"]["held"] and out.info["check"]["cosine"] > 0.99999
    compiled = ovr.compile_model(out.folder / ovr.IR_FILE, 1, "f32")
    np.testing.assert_allclose(compiled(feeds)[0], reference, rtol=1e-4, atol=1e-5)
    assert not any(p.name.endswith(".openvino-input") for p in tmp_path.iterdir()), "the rewritten copy is removed"


@pytest.mark.parametrize("model, rewritten", [
    (pooled(), True),                                              # ceil_mode, the window overhangs: one window
    (pooled(kernel=2, strides=2, ceil_mode=0), True),              # the window is the input exactly
    (pooled(op="MaxPool"), True),
    (pooled(kernel=64, strides=1), False),                         # overhangs by more than a stride: not one window
    (pooled(kernel=3, strides=3, ceil_mode=0), False),             # larger than the input without ceil_mode: invalid
    (pooled(kernel=1, strides=1), False),                          # a real pooling
    (pooled(pads=[1, 1, 1, 1]), False),                            # padded
    (pooled(spatial=("height", "width")), False),                  # dynamic spatial dims: another size may not fit
])
def test_only_pools_that_are_provably_global_are_rewritten(model, rewritten):
    assert whole_input_pools_as_global(model) == (["pool"] if rewritten else [])
    assert [n.op_type for n in model.graph.node][-1].startswith("Global") == rewritten
