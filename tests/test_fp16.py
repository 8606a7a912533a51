"""fp16 pass: conversion keeps FP32 I/O, the emulation shows FP16 overflow, the guard keeps the culprits in FP32."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, parser

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.evaluation.fp16_numerics import emulate_fp16
from optpipe.passes.fp16 import Fp16Params, Fp16Pass, convert_to_fp16

# A softmax-like normalisation whose ReduceSum exceeds FP16's 65504 (64 values of ~3000):
# harmless in FP32, inf in FP16, and the Div after it then returns zeros (cosine 0).
OVERFLOWING = """
<ir_version: 9, opset_import: ["" : 20]>
overflow (float[N, 64] x) => (float[N, 64] out) {
  w = Constant<value = float {3000.0}>()
  y = Mul(x, w)
  r = Relu(y)
  axes = Constant<value = int64[1] {1}>()
  s = ReduceSum<keepdims=1>(r, axes)
  q = Div(r, s)
  two = Constant<value = float {2.0}>()
  out = Mul(q, two)
}
"""


def overflow_case(tmp_path):
    model = parser.parse_model(OVERFLOWING)
    recipe = graph_recipe([{"name": "x", "shape": ["N", 64]}], dims={"N": {"min": 1, "opt": 4, "max": 16}})
    x = np.random.default_rng(0).uniform(0.5, 1.5, (16, 64)).astype(np.float32)
    return artifact_of(model, tmp_path / "in"), recipe, {"x": x}


def run_pass(params: dict, source, recipe, arrays, workdir):
    ctx = context(recipe, workdir, arrays)
    Fp16Pass(Fp16Params(**params)).run(source, ctx)
    from optpipe.core.artifact import ModelArtifact

    return ModelArtifact.open(workdir)


def test_conversion_keeps_float32_io_and_stores_weights_in_fp16(tmp_path):
    model = parser.parse_model(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        mm (float[N, 8] x) => (float[N, 4] y) {
          y = MatMul(x, w)
        }
        """
    )
    w = onnx.numpy_helper.from_array(np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32), "w")
    model.graph.initializer.append(w)
    converted = convert_to_fp16(model, keep_io_types=True, op_block_list=None, node_block_list=[])
    onnx.checker.check_model(converted, full_check=True)
    assert converted.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert converted.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {init.data_type for init in converted.graph.initializer} == {TensorProto.FLOAT16}
    x = np.random.default_rng(2).normal(size=(3, 8)).astype(np.float32)
    (path := tmp_path / "m.onnx").write_bytes(converted.SerializeToString())
    expected = x @ onnx.numpy_helper.to_array(w)
    np.testing.assert_allclose(run_model(path, {"x": x})[0], expected, rtol=5e-3, atol=5e-3)


def test_emulation_shows_the_overflow_that_ort_cpu_hides(tmp_path):
    model = parser.parse_model(OVERFLOWING)
    converted = convert_to_fp16(model, keep_io_types=True, op_block_list=None, node_block_list=[])
    x = np.random.default_rng(0).uniform(0.5, 1.5, (2, 64)).astype(np.float32)
    (plain := tmp_path / "plain.onnx").write_bytes(converted.SerializeToString())
    (emulated := tmp_path / "emulated.onnx").write_bytes(emulate_fp16(converted).SerializeToString())
    (fp32 := tmp_path / "fp32.onnx").write_bytes(model.SerializeToString())
    reference = run_model(fp32, {"x": x})[0]
    # ORT's CPU provider computes the 'FP16' ops in FP32 between its own Casts: no overflow is visible.
    np.testing.assert_allclose(run_model(plain, {"x": x})[0], reference, rtol=1e-3)
    # The emulation rounds every FP16 tensor: ReduceSum overflows, Div returns 0.
    np.testing.assert_array_equal(run_model(emulated, {"x": x})[0], np.zeros_like(reference))


def test_plain_fp16_breaks_the_tolerance_and_the_guard_restores_it(tmp_path):
    source, recipe, arrays = overflow_case(tmp_path)
    plain = run_pass({"guard": False}, source, recipe, arrays, tmp_path / "plain")
    assert plain.info["fp32_nodes"] == []
    # Off, the guard still measures the emulated FP16 figure once, and says it is out of tolerance.
    assert not plain.info["guard"]["held"] and plain.info["guard"]["gave_up"] == "the guard is off (guard: false)"
    guarded = run_pass({}, source, recipe, arrays, tmp_path / "guarded")
    guard = guarded.info["guard"]
    assert guard["numerics"] == "emulated FP16 storage"
    assert not guard["first"]["within_tolerance"]
    assert guard["first"]["cosine"] < 0.99
    assert guard["held"] and guard["cosine"] > 0.999 and guard["gave_up"] is None
    kept = {k["node"]: k for k in guarded.info["fp32_nodes"]}
    ops = {k["op"] for k in kept.values()}
    # The overflowing ReduceSum and the Div reading its sum; the Muls and the Relu stay FP16.
    assert ops == {"ReduceSum", "Div"}
    reduce_sum = next(k for k in kept.values() if k["op"] == "ReduceSum")
    assert "overflows" in reduce_sum["reason"]
    assert all(step["bought_cosine"] is not None for step in guard["steps"])
    # The artifact really has those nodes in FP32, and its emulated FP16 numerics match FP32.
    model = guarded.load()
    x = arrays["x"][:4]
    reference = run_model(source.path, {"x": x})[0]
    (emulated := tmp_path / "e.onnx").write_bytes(emulate_fp16(model).SerializeToString())
    np.testing.assert_allclose(run_model(emulated, {"x": x})[0], reference, rtol=2e-3, atol=1e-5)


def test_guard_stops_at_its_limit_and_says_so(tmp_path):
    source, recipe, arrays = overflow_case(tmp_path)
    # fp16's old name for the limit still reads.
    limited = run_pass({"max_kept_nodes": 1}, source, recipe, arrays, tmp_path / "limited")
    guard = limited.info["guard"]
    assert guard["excluded"] == [k["node"] for k in limited.info["fp32_nodes"]] and len(guard["excluded"]) == 1
    assert not guard["held"] and "max_excluded: 1" in guard["gave_up"]


def test_unknown_node_in_block_list_is_a_clear_error(tmp_path):
    from optpipe.core.errors import PassError

    source, recipe, arrays = overflow_case(tmp_path)
    with pytest.raises(PassError, match="node_block_list"):
        run_pass({"node_block_list": ["nope"]}, source, recipe, arrays, tmp_path / "bad")


def test_a_loop_body_is_emulated_in_fp16_too(tmp_path):
    """The emulation left a Loop's body in FP16 inside its FP32 graph: ONNX Runtime refused the type mismatch and
    the fp16 stage of a model with control flow failed as an internal error."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("h_out", TensorProto.FLOAT, None)])
    weights = [numpy_helper.from_array(rng.normal(size=(16, 16)).astype(np.float32) / 4, "w"),
               numpy_helper.from_array(np.array(3, np.int64), "trips"), numpy_helper.from_array(np.array(True), "go")]
    graph = helper.make_graph([helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    converted = convert_to_fp16(model, keep_io_types=True, op_block_list=None, node_block_list=[])
    (emulated := tmp_path / "emulated.onnx").write_bytes(emulate_fp16(converted).SerializeToString())
    (fp32 := tmp_path / "fp32.onnx").write_bytes(model.SerializeToString())
    x = rng.normal(size=(2, 16)).astype(np.float32)
    np.testing.assert_allclose(run_model(emulated, {"x": x})[0], run_model(fp32, {"x": x})[0], atol=5e-3)


def test_a_weight_kept_in_float_keeps_its_type_where_the_graph_declares_it():
    """A graph that declares a weight in value_info (ORT's fuser writes them): the converter turned the entry to FP16
    while the node kept in float kept its weight FP32, and shape inference, the FP16 emulation with it, refused the
    graph ("Inferred elem type differs ... (1) vs (10)"): an x-vector model's fp16 stage failed as an internal error."""
    model = parser.parse_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[N, 8] x) => (float[N, 4] logits, float[N, 6] emb) {
          emb = Gemm(x, w1)
          logits = Gemm(emb, w2)
        }
        """)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
    rng = np.random.default_rng(0)
    for name, shape in (("w1", (8, 6)), ("w2", (6, 4))):
        model.graph.initializer.append(onnx.numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name))
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("w2", TensorProto.FLOAT, [6, 4]))
    converted = convert_to_fp16(model, keep_io_types=True, op_block_list=None, node_block_list=["n1"])
    assert {i.name: i.data_type for i in converted.graph.initializer}["w2"] == TensorProto.FLOAT
    onnx.shape_inference.infer_shapes(converted)  # raised before
    import onnxruntime as ort

    x = rng.normal(size=(3, 8)).astype(np.float32)
    emb = x @ onnx.numpy_helper.to_array(model.graph.initializer[0])
    logits, emulated_emb = ort.InferenceSession(emulate_fp16(converted).SerializeToString()).run(["logits", "emb"], {"x": x})
    assert np.allclose(emulated_emb, emb, rtol=2e-3, atol=2e-3)  # n0 in FP16 storage
    assert np.allclose(logits, emulated_emb @ onnx.numpy_helper.to_array(model.graph.initializer[1]), rtol=1e-5, atol=1e-5)


def test_an_onnx_file_in_float16_is_refused_by_int8_in_one_line_and_init_leaves_int8_out(tmp_path, cli_run, monkeypatch):
    """ORT's quantizer wrote a graph ONNX Runtime refused: "internal error in pass 'int8' (... Type 'tensor(float16)')"."""
    import yaml
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(size=shape).astype(np.float16), name) for name, shape in (("w1", (16, 32)), ("w2", (32, 4)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 4])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "half.onnx")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "half.onnx", "-o", "half.yaml")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load((tmp_path / "half.yaml").read_text())
    assert not {"int8", "fp16"} & {spec["pass"] for spec in recipe["stages"].values()}
    assert "no int8 or fp16 stage: the model computes in float16 already" in (tmp_path / "half.yaml").read_text()
    recipe["data"] = {"eval": {"source": "synthetic", "samples": 4}, "calibration": {"source": "synthetic", "samples": 4}}
    recipe["stages"] = {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}}}
    (tmp_path / "half.yaml").write_text(yaml.safe_dump(recipe))
    result = cli_run("compile", "half.yaml")
    assert result.exit_code == 2, result.output
    assert "stages.int8: int8 quantizes a float32 model, and this one computes in float16 ('x')" in result.output
    assert "internal error" not in result.output
