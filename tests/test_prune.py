"""prune pass: structured pruning keeps graphs valid (through BN/ReLU/residual Add), FFN neurons go,
blocked groups stay whole, magnitude hits its sparsity, 2:4 holds its pattern."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.artifact import ModelArtifact
from optpipe.passes.prune import PruneParams, PrunePass
from optpipe.graph.sparsity import is_two_four, two_four

RNG = np.random.default_rng(0)


def _init(model: onnx.ModelProto, name: str, shape, scale=0.2) -> None:
    model.graph.initializer.append(numpy_helper.from_array((RNG.normal(size=shape) * scale).astype(np.float32), name))


def residual_cnn() -> onnx.ModelProto:
    """stem conv -> BN -> Relu -> [conv -> BN -> Relu -> conv -> BN] + shortcut -> Relu -> conv -> GAP -> Flatten -> Gemm."""
    model = parser.parse_model(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        cnn (float[N, 3, 16, 16] x) => (float[N, 10] logits) {
          a = Conv<pads = [1, 1, 1, 1]>(x, w0)
          b = BatchNormalization(a, g0, b0, m0, v0)
          c = Relu(b)
          d = Conv<pads = [1, 1, 1, 1]>(c, w1, bias1)
          e = BatchNormalization(d, g1, b1, m1, v1)
          f = Relu(e)
          g = Conv<pads = [1, 1, 1, 1]>(f, w2)
          h = BatchNormalization(g, g2, b2, m2, v2)
          i = Add(h, c)
          j = Relu(i)
          k = Conv(j, w3)
          l = GlobalAveragePool(k)
          m = Flatten(l)
          logits = Gemm<transB = 1>(m, wfc, bfc)
        }
        """
    )
    shapes = {
        "w0": (16, 3, 3, 3), "w1": (32, 16, 3, 3), "bias1": (32,), "w2": (16, 32, 3, 3), "w3": (24, 16, 1, 1),
        "wfc": (10, 24), "bfc": (10,),
    }
    for name, shape in shapes.items():
        _init(model, name, shape)
    for i, size in enumerate((16, 32, 16)):
        _init(model, f"g{i}", (size,), 1.0)
        _init(model, f"b{i}", (size,), 0.1)
        _init(model, f"m{i}", (size,), 0.1)
        model.graph.initializer.append(numpy_helper.from_array((np.abs(RNG.normal(size=size)) + 0.5).astype(np.float32), f"v{i}"))
    return model


def ffn_block() -> onnx.ModelProto:
    """A transformer FFN: MatMul -> bias -> GELU (erf form, as exported) -> MatMul -> bias -> + residual -> LayerNorm."""
    model = parser.parse_model(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        ffn (float[B, S, 32] x) => (float[B, S, 32] y) {
          h = MatMul(x, w1)
          hb = Add(h, b1)
          s2 = Constant<value = float {1.41421}>()
          q = Div(hb, s2)
          e = Erf(q)
          one = Constant<value = float {1.0}>()
          e1 = Add(e, one)
          p = Mul(hb, e1)
          half = Constant<value = float {0.5}>()
          gelu = Mul(p, half)
          o = MatMul(gelu, w2)
          ob = Add(o, b2)
          r = Add(ob, x)
          y = LayerNormalization<axis = -1>(r, ln_g, ln_b)
        }
        """
    )
    for name, shape in {"w1": (32, 128), "b1": (128,), "w2": (128, 32), "b2": (32,), "ln_g": (32,), "ln_b": (32,)}.items():
        _init(model, name, shape)
    return model


def prune(model, params, tmp_path, inputs, dims):
    source = artifact_of(model, tmp_path / "in")
    recipe = graph_recipe(inputs, dims=dims)
    ctx = context(recipe, tmp_path / "out", {})
    params = {"round_to": 8, **params}  # fixed, so channel counts do not depend on this machine's SIMD width
    PrunePass(PruneParams(**params)).run(source, ctx)
    return source, ModelArtifact.open(tmp_path / "out")


CNN_INPUTS = [{"name": "x", "shape": ["N", 3, 16, 16]}]
CNN_DIMS = {"N": {"min": 1, "opt": 2, "max": 8}}


def test_structured_prune_removes_channels_through_bn_relu_and_residual_add(tmp_path):
    source, pruned = prune(residual_cnn(), {"amount": 0.5}, tmp_path, CNN_INPUTS, CNN_DIMS)
    model = pruned.load()
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    # Internal channels of the block (32 -> 16) and the residual stream (stem, w2, BN0/BN2, w1 and w3 inputs: 16 -> 8).
    assert weights["w1"].shape == (16, 8, 3, 3) and weights["bias1"].shape == (16,)
    assert weights["g1"].shape == (16,)
    assert weights["w0"].shape == (8, 3, 3, 3) and weights["w2"].shape == (8, 16, 3, 3)
    assert weights["g0"].shape == weights["g2"].shape == (8,)
    # The last conv feeds Flatten -> Gemm: its channels are kept whole.
    assert weights["w3"].shape == (24, 8, 1, 1) and weights["wfc"].shape == (10, 24)
    info = pruned.info
    assert info["groups_pruned"] == 2 and info["channels_removed"] == 16 + 8
    assert "read by Flatten" in info["kept_whole_because"]
    assert info["parameters_after"] < info["parameters_before"]
    x = RNG.normal(size=(3, 3, 16, 16)).astype(np.float32)
    assert run_model(pruned.path, {"x": x})[0].shape == (3, 10)


def test_structured_prune_can_leave_residual_streams_whole(tmp_path):
    _, pruned = prune(residual_cnn(), {"amount": 0.5, "residual_streams": False}, tmp_path, CNN_INPUTS, CNN_DIMS)
    weights = {i.name: numpy_helper.to_array(i) for i in pruned.load().graph.initializer}
    assert weights["w1"].shape == (16, 16, 3, 3) and weights["w2"].shape == (16, 16, 3, 3)
    assert weights["w0"].shape == (16, 3, 3, 3)


def test_structured_prune_removes_ffn_neurons_but_not_the_layernorm_stream(tmp_path):
    source, pruned = prune(
        ffn_block(), {"amount": 0.5}, tmp_path, [{"name": "x", "shape": ["B", "S", 32]}],
        {"B": {"min": 1, "opt": 1, "max": 4}, "S": {"min": 1, "opt": 8, "max": 16}},
    )
    weights = {i.name: numpy_helper.to_array(i) for i in pruned.load().graph.initializer}
    assert weights["w1"].shape == (32, 64) and weights["b1"].shape == (64,) and weights["w2"].shape == (64, 32)
    assert weights["b2"].shape == (32,)  # the residual/LayerNorm stream is kept whole
    assert pruned.info["pruned"][0]["kind"] == "MatMul output features (neurons)"
    x = RNG.normal(size=(2, 5, 32)).astype(np.float32)
    out = run_model(pruned.path, {"x": x})[0]
    assert out.shape == (2, 5, 32) and np.isfinite(out).all()


def test_structured_prune_keeps_the_most_important_neurons(tmp_path):
    model = ffn_block()
    w1 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w1")).copy()
    w1[:, 100:] *= 50.0  # neurons 100..127 dominate
    next(i for i in model.graph.initializer if i.name == "w1").CopyFrom(numpy_helper.from_array(w1, "w1"))
    _, pruned = prune(
        model, {"amount": 0.75, "round_to": 4}, tmp_path, [{"name": "x", "shape": ["B", "S", 32]}],
        {"B": {"min": 1, "opt": 1, "max": 4}, "S": {"min": 1, "opt": 8, "max": 16}},
    )
    kept = numpy_helper.to_array(next(i for i in pruned.load().graph.initializer if i.name == "w1"))
    assert kept.shape == (32, 32)
    np.testing.assert_array_equal(kept[:, 4:], w1[:, 100:])  # all 28 big ones survive, in order


def test_nothing_sound_to_prune_is_a_clear_error(tmp_path):
    from optpipe.core.errors import PassError

    model = parser.parse_model(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[N, 8] x) => (float[N, 4] y) {
          y = MatMul(x, w)
        }
        """
    )
    _init(model, "w", (8, 4))
    with pytest.raises(PassError, match="magnitude"):
        prune(model, {"amount": 0.5}, tmp_path, [{"name": "x", "shape": ["N", 8]}], {"N": {"min": 1, "opt": 2, "max": 4}})


def test_magnitude_prune_reaches_the_requested_sparsity(tmp_path):
    _, pruned = prune(residual_cnn(), {"method": "magnitude", "amount": 0.8}, tmp_path, CNN_INPUTS, CNN_DIMS)
    assert pruned.info["sparsity"] == pytest.approx(0.8, abs=0.005)
    for layer in pruned.info["sparse_layers"]:
        assert layer["sparsity"] == pytest.approx(0.8, abs=0.02)
    weights = {i.name: numpy_helper.to_array(i) for i in pruned.load().graph.initializer}
    assert weights["w1"].shape == (32, 16, 3, 3)  # zeros, not removal


def test_two_four_pattern_is_applied_and_verified(tmp_path):
    _, pruned = prune(residual_cnn(), {"method": "2:4"}, tmp_path, CNN_INPUTS, CNN_DIMS)
    info = pruned.info
    assert info["pattern_verified"]
    assert [s["node"] for s in info["skipped"]] == ["Conv_0"]  # the stem conv has 3 input channels
    weights = {i.name: numpy_helper.to_array(i) for i in pruned.load().graph.initializer}
    # Independent check of TensorRT's rule: for each output channel and kernel position, every 4 input channels hold >= 2 zeros.
    for name in ("w1", "w2", "w3"):
        w = weights[name]
        groups = w.reshape(w.shape[0], w.shape[1] // 4, 4, *w.shape[2:])
        assert ((groups == 0).sum(axis=2) >= 2).all(), name
    fc = weights["wfc"]  # Gemm transB=1: [out, in], groups along `in`
    assert ((fc.reshape(10, 6, 4) == 0).sum(axis=2) >= 2).all()
    assert info["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_two_four_keeps_the_two_largest_of_each_four():
    w = np.array([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, -0.2, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(two_four(w, axis=1), [[0, -3.0, 2.0, 0, 1.0, 1.0, 0, 0]])
    assert is_two_four(two_four(w, axis=1), axis=1)
    assert not is_two_four(w, axis=1)


def test_amount_is_required_except_for_two_four():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs `amount`"):
        PruneParams(method="structured")
    with pytest.raises(ValidationError, match="remove `amount`"):
        PruneParams(method="2:4", amount=0.7)
