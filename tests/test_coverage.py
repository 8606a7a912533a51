"""Coverage: every stage shows the precision it computes in; int8 after fuse on a CNN quantizes
the convolutions (FusedConv split back); a quantization stage left mostly in float warns;
`validate` catches the stage orders and missing data that cannot work, without a model run."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.errors import RecipeError
from optpipe.evaluation.verdict import stage_coverage
from optpipe.graph.coverage import precision_coverage, quantization_warning
from optpipe.graph.unfuse import unfuse
from optpipe.passes import registry
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.validate import validate_recipe

SIZE = 16


def cnn_bn_relu(seed: int = 0, channels=(3, 8, 16), classes: int = 10) -> onnx.ModelProto:
    """Conv+BatchNorm+Relu blocks, global pooling, a Gemm head: the CNN shape `fuse` turns into FusedConv."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "images"
    for i, (cin, cout) in enumerate(zip(channels, channels[1:])):
        arrays = {
            f"w{i}": rng.normal(0, (2 / (cin * 9)) ** 0.5, (cout, cin, 3, 3)), f"b{i}": rng.normal(0, 0.1, cout),
            f"scale{i}": rng.uniform(0.5, 1.5, cout), f"bias{i}": rng.normal(0, 0.1, cout),
            f"mean{i}": rng.normal(0, 0.1, cout), f"var{i}": rng.uniform(0.5, 1.5, cout),
        }
        inits += [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
        nodes += [
            helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", f"scale{i}", f"bias{i}", f"mean{i}", f"var{i}"], [f"n{i}"], name=f"bn{i}"),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        x = f"r{i}"
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pool"], name="pool"),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fcw", "fcb"], ["logits"], name="fc", transB=1),
    ]
    inits += [numpy_helper.from_array(rng.normal(0, 0.3, (classes, channels[-1])).astype(np.float32), "fcw"),
              numpy_helper.from_array(np.zeros(classes, np.float32), "fcb")]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", channels[0], SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(scope="module")
def cnn_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coverage")
    recipe = graph_recipe([{"name": "images", "shape": ["batch", 3, SIZE, SIZE]}], {"batch": {"min": 1, "opt": 1, "max": 8}})
    images = {"images": np.random.default_rng(1).normal(size=(16, 3, SIZE, SIZE)).astype(np.float32)}
    exported = artifact_of(cnn_bn_relu(), tmp / "export")
    passes = registry()
    fused = passes["fuse"](passes["fuse"].Params(transformer="off")).run(exported, context(recipe, tmp / "fuse", images))
    return tmp, recipe, images, exported, fused, passes


def test_fused_cnn_reports_fusedconv_as_float_compute(cnn_setup):
    _, _, _, exported, fused, _ = cnn_setup
    assert fused.info["op_changes"].get("com.microsoft.FusedConv") == 2
    plain = precision_coverage(exported.load(with_weights=False), {"batch": 1})
    after_fuse = precision_coverage(fused.load(with_weights=False), {"batch": 1})
    # Conv MACs: 16*16*8*27 + 16*16*16*72 = 350208, Gemm 160: shape inference reaches the fused ops too.
    assert plain.total_macs == after_fuse.total_macs == 350208 + 160
    assert after_fuse.macs == {"fp32": 1.0}
    top = after_fuse.float_compute[0]
    assert top.op == "com.microsoft.FusedConv" and top.nodes == 2 and top.mac_share > 0.99
    assert "fused op" in top.reason


def test_int8_after_fuse_quantizes_the_convolutions(cnn_setup):
    tmp, recipe, images, _, fused, passes = cnn_setup
    int8 = passes["int8"](passes["int8"].Params(guard=False))
    out = int8.run(fused, context(recipe, tmp / "int8", images))
    assert out.info["prepared"]["split_fused_ops"] == {"FusedConv": 2}
    coverage = precision_coverage(out.load(with_weights=False), {"batch": 1})
    assert coverage.share("int8") == 1.0 and coverage.share("int8", "weights") > 0.9
    assert out.info["coverage"]["macs"] == {"int8": 1.0}
    # Still the same function: int8 error on this net is a few percent of the logits' spread.
    ref, got = run_model(fused.path, images)[0], run_model(out.path, images)[0]
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_unfuse_is_exact(cnn_setup):
    tmp, _, images, _, fused, _ = cnn_setup
    split, counts = unfuse(fused.load())
    assert counts == {"FusedConv": 2}
    assert not any(n.domain == "com.microsoft" for n in split.graph.node)
    ref = run_model(fused.path, images)[0]
    got = run_model(artifact_of(split, tmp / "split").path, images)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_quantization_left_in_float_warns_naming_the_op(cnn_setup):
    tmp, recipe, images, exported, _, passes = cnn_setup
    gemm_only = passes["int8"](passes["int8"].Params(op_types=["Gemm"], guard=False))
    out = gemm_only.run(exported, context(recipe, tmp / "int8-gemm", images))
    coverage, warnings = stage_coverage(out, {"batch": 1}, "int8")
    assert coverage.share("int8") < 0.01
    assert len(warnings) == 1 and "Conv" in warnings[0] and "0%" in warnings[0]
    # The same graph from a non-quantizing pass is not a warning: fp32 is what it is meant to be.
    assert stage_coverage(exported, {"batch": 1}, "simplify")[1] == []
    assert quantization_warning(precision_coverage(exported.load(), {"batch": 1})) is not None
    # The report shows the column, the warning and what was left in float, and why.
    from optpipe.reporting.run_report import build_report, render_markdown
    from optpipe.results import StageResult

    stage = StageResult(name="int8", pass_name="int8", status="ok", coverage=coverage, warnings=warnings)
    text = render_markdown(build_report(recipe, [stage]))
    assert "| precision (MACs) |" in text and "fp32 100% ⚠" in text
    assert "## Left in float by the quantization stages" in text and "Conv in fp32 (100%: not quantized)" in text


def _recipe(stages: dict, data: dict | None = None):
    return parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}], "stages": stages, "data": data or {}})


def test_validate_rejects_prune_after_fuse_and_says_which_order_works():
    stages = {"export": {"pass": "export"}, "fuse": {"pass": "fuse", "after": "export"},
              "prune": {"pass": "prune", "after": "fuse", "params": {"method": "structured", "amount": 0.25}}}
    with pytest.raises(RecipeError, match=r"stages.prune: prune after fuse .*after: export"):
        validate_recipe(_recipe(stages))
    stages["prune"]["after"] = "export"
    validate_recipe(_recipe(stages))


def test_validate_rejects_static_int8_without_calibration_data():
    stages = {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export"}}
    with pytest.raises(RecipeError, match=r"stages.int8: static int8 .*data.calibration"):
        validate_recipe(_recipe(stages))
    validate_recipe(_recipe({**stages, "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}}}))
    validate_recipe(_recipe(stages, {"calibration": {"source": "synthetic"}}))


def classifier_with_weight_value_info() -> onnx.ModelProto:
    """A classifier whose weights also have value_info entries, as onnxscript's fusion writes them
    (measured: 33 of 93 value_info entries of a fused 2-layer BERT classifier name initializers)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (16, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (3, 16)).astype(np.float32), "head_w"),
             numpy_helper.from_array(np.zeros(3, np.float32), "head_b")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="hidden"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "head_w", "head_b"], ["logits"], name="head", transB=1)]
    graph = helper.make_graph(nodes, "cls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], inits)
    graph.value_info.extend(helper.make_tensor_value_info(i.name, TensorProto.FLOAT, list(i.dims)) for i in inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_dynamic_int8_of_a_graph_with_initializer_value_info(tmp_path):
    """The cause of "Inferred shape and existing shape differ in dimension 0" after onnxscript fusion:
    ORT's dynamic quantizer transposes the Gemm head's weight [3, 16] in place, and the weight's own
    value_info entry says [3, 16] still. int8 drops those duplicates of the weights' dims first."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = classifier_with_weight_value_info()
    with pytest.raises(Exception, match="differ in dimension 0"):
        quantize_dynamic(model, tmp_path / "raw.onnx", weight_type=QuantType.QInt8)
    recipe = graph_recipe([{"name": "x", "shape": ["batch", 16]}], {"batch": {"min": 1, "opt": 1, "max": 8}})
    x = {"x": np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)}
    passes = registry()
    out = passes["int8"](passes["int8"].Params(mode="dynamic")).run(artifact_of(model, tmp_path / "in"), context(recipe, tmp_path / "q", x))
    assert out.info["prepared"]["dropped_initializer_value_info"] == 3
    assert out.info["coverage"]["macs"] == {"int8": 1.0}
    ref, got = run_model(tmp_path / "in" / "model.onnx", x)[0], run_model(out.path, x)[0]
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_validate_rejects_a_language_model_task_without_its_token_input():
    stages = {"export": {"pass": "export"}}
    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "ids", "dtype": "int64", "shape": [1, 8]}],
                           "stages": stages, "evaluate": {"task": {"kind": "language-model"}}})
    with pytest.raises(RecipeError, match="evaluate.task.tokens: no input 'input_ids'"):
        validate_recipe(recipe)
    validate_recipe(recipe.model_copy(update={"evaluate": recipe.evaluate.model_copy(
        update={"task": recipe.evaluate.task.model_copy(update={"tokens": "ids"})})}))
