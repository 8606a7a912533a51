"""fuse pass on hand-built graphs: transformer fusions (both fusers), ORT's generic fusions, numerics, the record."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.artifact import ModelArtifact
from optpipe.execution.stage_runner import run_checked
from optpipe.graph.stats import op_histogram
from optpipe.passes.fuse import FuseParams, FusePass

RNG = np.random.default_rng(0)

SKIP_LAYER_NORM = """
<ir_version: 9, opset_import: ["" : 20]>
block (float[N, 4, 8] x, float[N, 4, 8] skip) => (float[N, 4, 8] y) {
  s = Add(x, skip)
  y = LayerNormalization<axis = -1, epsilon = 0.00001>(s, gamma, beta)
}
"""

CONV_BN_RELU = """
<ir_version: 9, opset_import: ["" : 20]>
cnn (float[N, 3, 8, 8] x) => (float[N, 4, 8, 8] y) {
  c = Conv<pads = [1, 1, 1, 1]>(x, w, b)
  n = BatchNormalization(c, scale, bias, mean, var)
  y = Relu(n)
}
"""


def add_weights(model: onnx.ModelProto, **arrays: np.ndarray) -> onnx.ModelProto:
    for name, array in arrays.items():
        model.graph.initializer.append(numpy_helper.from_array(array.astype(np.float32), name))
    for i, node in enumerate(model.graph.node):
        node.name = f"{node.op_type.lower()}_{i}"
    return model


def run_fuse(source, recipe, arrays, workdir, **params) -> ModelArtifact:
    return run_checked(FusePass(FuseParams(**params)), source, context(recipe, workdir, arrays))


def transformer_case(tmp_path):
    model = add_weights(parser.parse_model(SKIP_LAYER_NORM), gamma=RNG.uniform(0.5, 1.5, 8), beta=RNG.normal(size=8))
    dims = {"N": {"min": 1, "opt": 2, "max": 8}}
    recipe = graph_recipe([{"name": "x", "shape": ["N", 4, 8]}, {"name": "skip", "shape": ["N", 4, 8]}], dims=dims)
    arrays = {name: RNG.normal(size=(4, 4, 8)).astype(np.float32) for name in ("x", "skip")}
    return artifact_of(model, tmp_path / "in"), recipe, arrays


def test_transformer_fusion_tries_both_fusers_and_records_what_it_fused(tmp_path):
    source, recipe, arrays = transformer_case(tmp_path)
    out = run_fuse(source, recipe, arrays, tmp_path / "out", generic=False)
    assert out.info["fused_ops"] == {"SkipLayerNormalization": 1}
    assert out.info["op_changes"]["Add"] == -1 and out.info["op_changes"]["LayerNormalization"] == -1
    transformer = out.info["transformer"]
    assert transformer["fuser"] in ("onnxscript", "ort")
    assert set(transformer["candidates"]) == {"onnxscript", "ort"}
    assert all(c["fused_ops"] == {"SkipLayerNormalization": 1} for c in transformer["candidates"].values())
    np.testing.assert_allclose(run_model(out.path, arrays)[0], run_model(source.path, arrays)[0], atol=1e-5)
    assert out.info["self_check"]["max_abs"] < 1e-4


def test_each_fuser_can_be_chosen(tmp_path):
    source, recipe, arrays = transformer_case(tmp_path)
    for fuser in ("onnxscript", "ort"):
        out = run_fuse(source, recipe, arrays, tmp_path / fuser, transformer=fuser, generic=False)
        assert out.info["transformer"]["fuser"] == fuser
        assert list(out.info["transformer"]["candidates"]) == [fuser]


def test_generic_fusions_fold_batchnorm_and_fuse_the_activation(tmp_path):
    model = add_weights(
        parser.parse_model(CONV_BN_RELU),
        w=RNG.normal(size=(4, 3, 3, 3)), b=RNG.normal(size=4), scale=RNG.uniform(0.5, 2, 4),
        bias=RNG.normal(size=4), mean=RNG.normal(size=4), var=RNG.uniform(0.5, 2, 4),
    )
    recipe = graph_recipe([{"name": "x", "shape": ["N", 3, 8, 8]}], dims={"N": {"min": 1, "opt": 2, "max": 4}})
    arrays = {"x": RNG.normal(size=(2, 3, 8, 8)).astype(np.float32)}
    source = artifact_of(model, tmp_path / "in")
    out = run_fuse(source, recipe, arrays, tmp_path / "out")
    ops = op_histogram(out.load(with_weights=False))
    assert "BatchNormalization" not in ops and "Relu" not in ops
    assert out.info["fused_ops"] == {"FusedConv": 1}
    assert out.info["generic"]["level"] == "extended"
    assert out.info["transformer"]["fuser"] is None  # nothing transformer-shaped here: input kept as is
    np.testing.assert_allclose(run_model(out.path, arrays)[0], run_model(source.path, arrays)[0], atol=1e-4)


def test_nothing_enabled_leaves_the_graph_as_it_was(tmp_path):
    source, recipe, arrays = transformer_case(tmp_path)
    out = run_fuse(source, recipe, arrays, tmp_path / "out", transformer="off", generic=False)
    assert op_histogram(out.load()) == op_histogram(source.load())
    assert out.info["fused_ops"] == {} and out.info["op_changes"] == {}


# One self-attention block as the dynamo exporter writes it (Q/K/V projections, heads split by
# Reshape/Transpose, scaled scores, additive mask from attention_mask, softmax, heads merged).
ATTENTION = """
<ir_version: 9, opset_import: ["" : 18]>
attention (float[B, S, 16] x, int64[B, S] attention_mask) => (float[B, S, 16] y) {
  heads = Constant<value = int64[4] {0, 0, 2, 8}>()
  merged = Constant<value = int64[3] {0, 0, 16}>()
  qm = MatMul(x, wq)
  qb = Add(qm, bq)
  qr = Reshape(qb, heads)
  q = Transpose<perm = [0, 2, 1, 3]>(qr)
  km = MatMul(x, wk)
  kb = Add(km, bk)
  kr = Reshape(kb, heads)
  kt = Transpose<perm = [0, 2, 3, 1]>(kr)
  vm = MatMul(x, wv)
  vb = Add(vm, bv)
  vr = Reshape(vb, heads)
  v = Transpose<perm = [0, 2, 1, 3]>(vr)
  axes = Constant<value = int64[2] {1, 2}>()
  m4 = Unsqueeze(attention_mask, axes)
  mf = Cast<to = 1>(m4)
  one = Constant<value = float {1.0}>()
  inv = Sub(one, mf)
  big = Constant<value = float {-10000.0}>()
  bias = Mul(inv, big)
  scores = MatMul(q, kt)
  scale = Constant<value = float {0.35355339}>()
  scaled = Mul(scores, scale)
  masked = Add(scaled, bias)
  probs = Softmax<axis = -1>(masked)
  ctx = MatMul(probs, v)
  ctxt = Transpose<perm = [0, 2, 1, 3]>(ctx)
  y = Reshape(ctxt, merged)
}
"""


def attention_case(tmp_path):
    weights = {f"w{n}": RNG.normal(size=(16, 16)) * 0.3 for n in "qkv"} | {f"b{n}": RNG.normal(size=16) * 0.1 for n in "qkv"}
    model = add_weights(parser.parse_model(ATTENTION), **weights)
    dims = {"B": {"min": 1, "opt": 2, "max": 4}, "S": {"min": 1, "opt": 6, "max": 8}}
    recipe = graph_recipe([{"name": "x", "shape": ["B", "S", 16]},
                           {"name": "attention_mask", "dtype": "int64", "shape": ["B", "S"]}], dims=dims)
    mask = np.ones((4, 6), np.int64)
    mask[1, 4:] = 0  # real padding: the fused op must honour the mask
    arrays = {"x": RNG.normal(size=(4, 6, 16)).astype(np.float32), "attention_mask": mask}
    return artifact_of(model, tmp_path / "in"), recipe, arrays


def test_onnxscript_fuses_attention_without_patching_it(tmp_path):
    """Fails if onnxscript's public rules stop fusing attention (a rename, a new version)."""
    source, recipe, arrays = attention_case(tmp_path)
    for mode in ("separate", "packed"):
        out = run_fuse(source, recipe, arrays, tmp_path / mode, transformer="onnxscript", attention=mode, generic=False)
        fused = out.info["fused_ops"]
        assert any(op in fused for op in ("Attention", "MultiHeadAttention")), (mode, fused)
        if mode == "separate":
            # Q/K/V stay three MatMuls with their own weights (what int8 quantizes): no packed Attention.
            assert fused.get("MultiHeadAttention") == 1 and "Attention" not in fused
            assert op_histogram(out.load(with_weights=False))["MatMul"] == 3
        outputs = run_model(out.path, arrays)[0]
        np.testing.assert_allclose(outputs, run_model(source.path, arrays)[0], atol=1e-4)


def test_an_unknown_ort_model_type_is_refused_when_the_params_are_read():
    """ORT's optimizer fails on a model type it lacks only inside the pass, with an error about its
    table; the params name the field and the types it has."""
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="no model type 'bret'; use one of .*bert"):
        FuseParams(transformer="ort", model_type="bret")
    assert FuseParams(model_type="vit").model_type == "vit"
