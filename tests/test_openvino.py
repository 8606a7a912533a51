"""OpenVINO engine on hand-built graphs: ONNX -> IR, numerics against ONNX Runtime, NNCF INT8
that really runs int8 kernels, the precision recorded, the accuracy guard, and the evaluator."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.artifact import ModelArtifact
from optpipe.core.errors import PassError, RecipeError
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.passes._openvino_nncf import has_attention
from optpipe.passes.openvino import OpenVinoParams, OpenVinoPass

RNG = np.random.default_rng(0)

# x -> MatMul -> Relu -> MatMul -> y, weights large enough for NNCF to quantize both MatMuls.
MLP = """
<ir_version: 9, opset_import: ["" : 20]>
mlp (float[N, 64] x) => (float[N, 32] y) {
  h = MatMul (x, w1)
  r = Relu (h)
  y = MatMul (r, w2)
}
"""

# Self-attention over [N, T, 32]: Softmax(q k^T) v, with weight MatMuls around it.
ATTENTION = """
<ir_version: 9, opset_import: ["" : 20]>
attention (float[N, T, 32] x) => (float[N, T, 32] y) {
  q = MatMul (x, wq)
  k = MatMul (x, wk)
  v = MatMul (x, wv)
  kt = Transpose <perm = [0, 2, 1]> (k)
  s = MatMul (q, kt)
  p = Softmax <axis = -1> (s)
  a = MatMul (p, v)
  y = MatMul (a, wo)
}
"""


def mlp(tmp_path, outlier: bool = False):
    model = parser.parse_model(MLP)
    for i, node in enumerate(model.graph.node):
        node.name = f"node{i}"
    w1 = RNG.normal(size=(64, 128)).astype(np.float32) / 8
    if outlier:
        w1[0] = 0.0  # the outlier channel carries no signal, but per-tensor activation ranges must span it
    model.graph.initializer.append(numpy_helper.from_array(w1, "w1"))
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(128, 32)).astype(np.float32) / 8, "w2"))
    recipe = graph_recipe([{"name": "x", "shape": ["N", 64]}], dims={"N": {"min": 1, "opt": 4, "max": 32}})
    x = RNG.uniform(-1, 1, (32, 64)).astype(np.float32)
    if outlier:
        x[:, 0] = 3000.0
    return artifact_of(model, tmp_path / "in"), recipe, {"x": x}


def attention(tmp_path):
    model = parser.parse_model(ATTENTION)
    for name in ("wq", "wk", "wv", "wo"):
        model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(32, 32)).astype(np.float32) / 6, name))
    recipe = graph_recipe([{"name": "x", "shape": ["N", "T", 32]}],
                          dims={"N": {"min": 1, "opt": 2, "max": 8}, "T": {"min": 1, "opt": 16, "max": 64}})
    return artifact_of(model, tmp_path / "in"), recipe, {"x": RNG.normal(size=(16, 16, 32)).astype(np.float32)}


def run_pass(source, recipe, arrays, workdir, **params) -> ModelArtifact:
    OpenVinoPass(OpenVinoParams(**params)).run(source, context(recipe, workdir, arrays))
    return ModelArtifact.open(workdir)


def ov_outputs(artifact: ModelArtifact, feeds, hint="f32"):
    path, _, names = ovr.stage_settings(artifact)
    return ovr.runner(ovr.compile_model(path, 1, hint), names)(feeds)


def test_fp32_ir_matches_onnx_runtime_and_records_the_precision(tmp_path):
    source, recipe, arrays = mlp(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov")
    assert {p.name for p in out.files()} >= {"model.xml", "model.bin", "openvino.json", "info.json"}
    assert not (out.folder / "model.onnx").exists()
    assert ovr.is_ir(out.folder)
    expected = run_model(source.path, arrays)[0]
    got = ov_outputs(out, arrays)["y"]  # named as in the ONNX graph
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert out.info["inference_precision"] == "f32"
    assert out.info["int8_layers"] == 0
    assert out.info["check"]["held"] and out.info["check"]["cosine"] > 0.99999


def test_int8_runs_int8_kernels_and_stays_close(tmp_path):
    source, recipe, arrays = mlp(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8")
    ir = ovr.read_model(out.folder / "model.xml")
    assert sum(op.get_type_name() == "FakeQuantize" for op in ir.get_ops()) >= 2  # both MatMuls' inputs
    compiled = ovr.compile_model(out.folder / "model.xml", 1)
    layers = ovr.runtime_precisions(compiled, ovr.COMPUTE_LAYERS)
    assert layers.get("i8", 0) + layers.get("u8", 0) >= 2, layers  # the MatMuls run as int8 kernels
    assert out.info["int8_layers"] >= 2 and out.info["inference_precision"] == "f32"
    assert out.info["int8"]["guard"]["held"]
    expected = run_model(source.path, arrays)[0]
    got = ov_outputs(out, arrays)["y"]
    cos = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cos.mean() > 0.99
    assert np.abs(got - expected).max() > 1e-6  # quantized: not the FP32 numbers


def test_int8_guard_reverts_quantizers_until_the_tolerance_holds(tmp_path):
    # One input channel at 3000 with no signal: per-tensor int8 on x rounds the real channels away.
    source, recipe, arrays = mlp(tmp_path, outlier=True)
    plain = run_pass(source, recipe, arrays, tmp_path / "plain", precision="int8", guard=False)
    assert not plain.info["int8"]["guard"]["held"]
    guarded = run_pass(source, recipe, arrays, tmp_path / "guarded", precision="int8")
    guard = guarded.info["int8"]["guard"]
    # The cheap fix first: the MatMul fed by the outlier input, named by the layer-wise attribution, kept in float.
    assert [s["method"] for s in guard["steps"]] == ["nncf.quantize", "nncf.quantize, the 1 MatMul adding the most error in float"]
    assert guard["steps"][1]["excluded"] == ["node0"]
    assert guard["held"] and guard["cosine"] >= 0.99 and guard["gave_up"] is None
    assert guarded.info["int8"]["quantizers"] < plain.info["int8"]["quantizers"]


def test_int8_guard_on_a_model_without_a_batch_dim_checks_one_sample_at_a_time(tmp_path):
    # A fixed [1, 64] input: the input check and NNCF's accuracy control must feed batches of 1 (the
    # evaluation's rule for such models), not the recipe's accuracy_batch of 8, which the IR refuses.
    model = parser.parse_model(MLP.replace("float[N, 64] x", "float[1, 64] x").replace("float[N, 32] y", "float[1, 32] y"))
    for i, node in enumerate(model.graph.node):
        node.name = f"node{i}"
    w1 = RNG.normal(size=(64, 128)).astype(np.float32) / 8
    w1[0] = 0.0
    model.graph.initializer.append(numpy_helper.from_array(w1, "w1"))
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(128, 32)).astype(np.float32) / 8, "w2"))
    recipe = graph_recipe([{"name": "x", "shape": [1, 64]}], dims={})
    x = RNG.uniform(-1, 1, (16, 64)).astype(np.float32)
    x[:, 0] = 3000.0
    out = run_pass(artifact_of(model, tmp_path / "in"), recipe, {"x": x}, tmp_path / "ov", precision="int8")
    guard = out.info["int8"]["guard"]
    assert guard["steps"][0]["method"] == "nncf.quantize" and len(guard["steps"]) >= 2
    assert guard["held"] and guard["cosine"] >= 0.99


def test_exclude_types_keeps_those_ops_in_float(tmp_path):
    source, recipe, arrays = mlp(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", exclude_types=["MatMul"], guard=False)
    assert out.info["int8"]["quantizers"] == 0 and out.info["int8_layers"] == 0


def test_an_exclude_type_the_ir_lacks_is_refused_not_silently_ignored(tmp_path):
    # NNCF's ignored scope runs with validate=False: 'Matmul' would exclude nothing and say nothing.
    source, recipe, arrays = mlp(tmp_path)
    with pytest.raises(RecipeError, match=r"exclude_types: Matmul is no op type of this model's OpenVINO IR .*MatMul"):
        run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", exclude_types=["Matmul"], guard=False)


def test_attention_graph_is_quantized_as_a_transformer(tmp_path):
    source, recipe, arrays = attention(tmp_path)
    assert has_attention(source)
    mlp_source, _, _ = mlp(tmp_path / "mlp")
    assert not has_attention(mlp_source)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8")
    assert out.info["int8"]["options"]["model_type"] == "transformer"
    assert out.info["int8_layers"] > 0


def test_bf16_is_a_hint_on_the_same_ir_and_recorded(tmp_path):
    source, recipe, arrays = mlp(tmp_path)
    if not ovr.supports("bf16"):
        with pytest.raises(PassError, match="bf16"):
            run_pass(source, recipe, arrays, tmp_path / "ov", precision="bf16")
        return
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="bf16")
    assert json.loads((out.folder / "openvino.json").read_text())["hint"] == "bf16"
    assert out.info["inference_precision"] == "bf16"
    fp32 = run_pass(source, recipe, arrays, tmp_path / "fp32")
    # Same IR, another hint: the content hash (model + settings) differs, so results are not shared.
    assert (out.folder / "model.bin").read_bytes() == (fp32.folder / "model.bin").read_bytes()
    assert out.content_hash() != fp32.content_hash()


def test_no_onnx_pass_may_follow_an_openvino_stage():
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.plan.validate import validate_recipe

    data = {
        "model": {"onnx": "m.onnx"},
        "inputs": [{"name": "x", "shape": [1, 4]}],
        "stages": {"export": {"pass": "export"}, "ov": {"pass": "openvino", "after": "export"},
                   "int8": {"pass": "int8", "after": "ov"}},
    }
    with pytest.raises(RecipeError, match="stages.int8: stage 'ov' produces openvino-ir"):
        validate_recipe(parse_recipe(data))


@pytest.mark.parametrize("precision", ["fp32", "int8", "bf16"])
def test_the_pass_reads_its_precision_facts_from_the_model_its_check_compiled(tmp_path, monkeypatch, precision):
    """One compile fewer per stage (the check's compiled model is reused), and the same facts as a fresh
    compile of the saved IR at the stage's hint."""
    if not ovr.supports(precision):
        pytest.skip(f"this CPU runs no {precision} in OpenVINO")
    source, recipe, arrays = mlp(tmp_path)
    calls, compile_model = [], ovr.compile_model
    monkeypatch.setattr(ovr, "compile_model", lambda *a, **k: calls.append(a[0]) or compile_model(*a, **k))
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision=precision, guard=False)
    assert not any(isinstance(c, type(tmp_path)) for c in calls), calls  # the saved IR was not compiled again
    assert len(calls) == 1  # int8 and bf16: a result within tolerance vouches for the conversion (no f32 check)
    fresh = ovr.precision_facts(compile_model(out.folder / "model.xml", 2, ovr.read_settings(out.folder)["hint"]))
    assert {k: out.info[k] for k in fresh} == fresh
