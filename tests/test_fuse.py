"""fuse pass on hand-built graphs: transformer fusions (both fusers), ORT's generic fusions, numerics, the record."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.artifact import ModelArtifact
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
