"""int8 pass on hand-built graphs: the QDQ format TensorRT needs, dynamic mode, and the accuracy guard."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.artifact import ModelArtifact
from optpipe.passes.int8 import Int8Params, Int8Pass

RNG = np.random.default_rng(0)

# x -> MatMul -> Relu -> MatMul -> y: two weight MatMuls (what int8 quantizes).
MLP = """
<ir_version: 9, opset_import: ["" : 20]>
mlp (float[N, 16] x) => (float[N, 8] y) {
  h = MatMul (x, w1)
  r = Relu (h)
  y = MatMul (r, w2)
}
"""

# One input channel is ~1000x the others but carries no signal (its weight row is 0): a
# per-tensor int8 range for mm1's input then rounds every useful channel to 0.
OUTLIER = """
<ir_version: 9, opset_import: ["" : 20]>
outlier (float[N, 16] x) => (float[N, 8] y) {
  s = Mul (x, gain)
  h = MatMul (s, w1)
  r = Relu (h)
  y = MatMul (r, w2)
}
"""


NODE_NAMES = {"h": "mm1", "r": "relu", "y": "mm2", "s": "scale", "e": "embedding"}


def parse(text: str) -> onnx.ModelProto:
    """Parse a graph and name its nodes (the text format has no node names; the quantizer needs them)."""
    model = parser.parse_model(text)
    for node in model.graph.node:
        node.name = NODE_NAMES.get(node.output[0], node.output[0])
    return model


def with_weights(text: str, outlier: bool = False) -> onnx.ModelProto:
    model = parse(text)
    w1 = RNG.normal(size=(16, 32)).astype(np.float32)
    if outlier:
        w1[0] = 0.0
        gain = np.ones(16, np.float32)
        gain[0] = 2000.0
        model.graph.initializer.append(numpy_helper.from_array(gain, "gain"))
    model.graph.initializer.append(numpy_helper.from_array(w1, "w1"))
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(32, 8)).astype(np.float32), "w2"))
    return model


def case(tmp_path, text=MLP, outlier=False, cosine_min=0.99):
    recipe = graph_recipe([{"name": "x", "shape": ["N", 16]}], dims={"N": {"min": 1, "opt": 4, "max": 32}},
                          tolerance={"cosine_min": cosine_min})
    x = RNG.uniform(-1, 1, (32, 16)).astype(np.float32)
    if outlier:
        x[:, 0] = np.abs(x[:, 0])  # the outlier channel is always large and positive
    return artifact_of(with_weights(text, outlier), tmp_path / "in"), recipe, {"x": x}


def run_int8(source, recipe, arrays, workdir, **params) -> ModelArtifact:
    Int8Pass(Int8Params(**params)).run(source, context(recipe, workdir, arrays))
    return ModelArtifact.open(workdir)


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def test_static_writes_symmetric_signed_per_channel_qdq_on_inputs_only(tmp_path):
    source, recipe, arrays = case(tmp_path)
    out = run_int8(source, recipe, arrays, tmp_path / "out", mode="static", method="minmax")
    model = out.load()
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 2 and "QuantizeLinear" in ops and "DequantizeLinear" in ops
    inits = initializers(model)
    zero_points = [inits[n.input[2]] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    # Symmetric signed int8: every zero point is an int8 zero (TensorRT's explicit quantization).
    assert zero_points and all(zp.dtype == np.int8 and not zp.any() for zp in zero_points)
    # Per-channel weights: one scale per output column of each MatMul weight.
    weight_scales = {n.input[0]: inits[n.input[1]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    assert sorted(s.shape for s in weight_scales.values()) == [(8,), (32,)]
    # No int32 (bias) Q/DQ, and no Q/DQ on the MatMul outputs.
    assert not any(t.dtype == np.int32 for t in inits.values())
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    assert all(producers.get(n.input[0]) != "MatMul" for n in model.graph.node if n.op_type == "QuantizeLinear")
    assert out.info["calibration"]["method"] == "minmax" and out.info["guard"]["held"]
    (reference,) = run_model(source.path, arrays)
    (quantized,) = run_model(out.path, arrays)
    cosine = float((reference * quantized).sum() / np.linalg.norm(reference) / np.linalg.norm(quantized))
    assert cosine > 0.999  # measured 0.99997 on this graph


def test_static_for_ort_cpu_writes_uint8_activations_with_outputs_quantized(tmp_path):
    source, recipe, arrays = case(tmp_path)
    out = run_int8(source, recipe, arrays, tmp_path / "out", mode="static", target="ort-cpu")
    model = out.load()
    inits = initializers(model)
    activation_zero_points = [inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    # ORT's CPU form: asymmetric uint8 activations (zero points where the ranges put them) ...
    assert activation_zero_points and all(zp.dtype == np.uint8 for zp in activation_zero_points)
    # ... and Q/DQ on the MatMul outputs too, which is what lets ORT fuse them into QLinearMatMul.
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    assert any(producers.get(n.input[0]) == "MatMul" for n in model.graph.node if n.op_type == "QuantizeLinear")
    assert out.info["target"] == "ort-cpu" and not out.info["symmetric"]
    (reference,) = run_model(source.path, arrays)
    (quantized,) = run_model(out.path, arrays)
    cosine = float((reference * quantized).sum() / np.linalg.norm(reference) / np.linalg.norm(quantized))
    assert cosine > 0.999


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_static_calibration_methods_run(tmp_path, method):
    source, recipe, arrays = case(tmp_path)
    out = run_int8(source, recipe, arrays, tmp_path / "out", mode="static", method=method)
    assert out.info["calibration"]["method"] == method
    assert out.info["op_changes"]["QuantizeLinear"] >= 2


def test_dynamic_quantizes_matmuls_and_leaves_embedding_gathers_in_float(tmp_path):
    model = parse(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        embed (int64[N, 4] ids) => (float[N, 4, 8] y) {
          e = Gather (table, ids)
          y = MatMul (e, w)
        }
        """
    )
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(50, 16)).astype(np.float32), "table"))
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(16, 8)).astype(np.float32), "w"))
    recipe = graph_recipe([{"name": "ids", "dtype": "int64", "shape": ["N", 4], "range": [0, 50]}],
                          dims={"N": {"min": 1, "opt": 2, "max": 8}})
    arrays = {"ids": RNG.integers(0, 50, (8, 4)).astype(np.int64)}
    out = run_int8(artifact_of(model, tmp_path / "in"), recipe, arrays, tmp_path / "out", mode="dynamic")
    ops = [n.op_type for n in out.load().graph.node]
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops and "MatMul" not in ops
    gather = next(n for n in out.load().graph.node if n.op_type == "Gather")
    assert initializers(out.load())[gather.input[0]].dtype == np.float32
    assert out.info["calibration"] is None and out.info["guard"]["held"]


def test_guard_keeps_the_node_that_breaks_the_tolerance_in_float(tmp_path):
    source, recipe, arrays = case(tmp_path, OUTLIER, outlier=True)
    plain = run_int8(source, recipe, arrays, tmp_path / "plain", mode="static", guard=False)
    assert not plain.info["guard"]["held"]
    assert plain.info["guard"]["cosine"] < 0.5  # measured 0.0: the useful channels round to zero

    guarded = run_int8(source, recipe, arrays, tmp_path / "guarded", mode="static")
    guard = guarded.info["guard"]
    assert guard["held"] and guard["cosine"] >= 0.99
    assert guarded.info["excluded"] == ["mm1"]
    kept = [step for step in guard["steps"] if step["kept"]]
    assert [step["nodes"] for step in kept] == [["mm1"]] and guard["excluded"] == ["mm1"]
    assert kept[0]["bought_cosine"] > 0.9 and kept[0]["facts"]["mm1"]["float_weights"] == 16 * 32
    # mm1 stays a float MatMul with a float weight; mm2 is still quantized.
    model = guarded.load()
    mm1 = next(n for n in model.graph.node if n.name == "mm1")
    assert initializers(model).get(mm1.input[1], np.zeros(1, np.float32)).dtype == np.float32
    assert any(n.op_type == "DequantizeLinear" and n.input[0].startswith("w2") for n in model.graph.node)


def test_user_exclusions_are_kept_in_float(tmp_path):
    source, recipe, arrays = case(tmp_path)
    out = run_int8(source, recipe, arrays, tmp_path / "out", mode="dynamic", exclude=["mm2"])
    assert out.info["excluded"] == ["mm2"]
    assert [n.op_type for n in out.load().graph.node].count("MatMul") == 1


def test_unknown_method_is_a_recipe_error():
    from optpipe.core.errors import RecipeError
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.plan.validate import validate_recipe

    recipe = parse_recipe(
        {
            "model": {"onnx": "m.onnx"},
            "inputs": [{"name": "x", "shape": [1, 4]}],
            "stages": {"export": {"pass": "export"}, "q": {"pass": "int8", "after": "export", "params": {"method": "kl"}}},
        }
    )
    with pytest.raises(RecipeError, match=r"stages\.q\.params\.method"):
        validate_recipe(recipe)


def test_float_weights_type_is_float(tmp_path):
    # Guard against an accidental float64 in hand-built weights (ORT would reject the graph).
    source, _, _ = case(tmp_path)
    assert {init.data_type for init in source.load().graph.initializer} == {TensorProto.FLOAT}


def test_a_graph_whose_compute_is_in_a_loop_body_says_int8_quantized_nothing(tmp_path):
    # A scripted loop exported to ONNX: ORT's quantizer leaves Loop bodies alone, and the stage read "ok, fp32 100%"
    # with nothing to say it was its input model.
    from onnx import helper

    from optpipe.evaluation.verdict import pass_warnings

    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "w"], ["h_out"], name="body_mm")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_tensor_value_info("h_out", TensorProto.FLOAT, None)])
    body.node.insert(0, helper.make_node("Identity", ["c"], ["c_out"]))
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body, name="loop")], "looped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])],
        [numpy_helper.from_array(np.array(3, np.int64), "trips"), numpy_helper.from_array(RNG.normal(size=(16, 16)).astype(np.float32) / 4, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    recipe = graph_recipe([{"name": "x", "shape": ["N", 16]}], dims={"N": {"min": 1, "opt": 2, "max": 8}})
    out = run_int8(artifact_of(model, tmp_path / "in"), recipe, {"x": RNG.normal(size=(8, 16)).astype(np.float32)},
                   tmp_path / "out", mode="dynamic")
    assert out.info["op_changes"] == {}
    assert any("int8 quantized no node: its compute is inside Loop bodies" in w for w in pass_warnings(out.info))
