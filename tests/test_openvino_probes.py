"""The OpenVINO pass on models its first tests did not use: a fixed batch above one, ONNX nodes the
converter splits (Gemm with bias), ops OpenVINO cannot convert, and int8-only params on an fp32 stage.
Hand-built graphs: each test runs in a few seconds."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper, parser

from helpers_passes import artifact_of, context, graph_recipe
from optpipe.core.artifact import ModelArtifact
from optpipe.core.errors import PassError, RecipeError, first_line
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.evaluation.verdict import ignored_params_warning, openvino_int8_warning
from optpipe.passes.openvino import OpenVinoParams, OpenVinoPass

RNG = np.random.default_rng(7)

# Two Gemm layers with biases, named fc1 / fc2: OpenVINO converts each into a MatMul named
# 'fc1/WithoutBiases' plus an Add named after the node (or its output tensor).
GEMMS = """
<ir_version: 9, opset_import: ["" : 17]>
gemms (float[B, 24] x) => (float[B, 10] y) {
  h = Gemm (x, w1, b1)
  r = Relu (h)
  y = Gemm (r, w2, b2)
}
"""


def gemms(tmp_path, batch: int | str = "B"):
    text = GEMMS.replace("float[B, 24] x", f"float[{batch}, 24] x").replace("float[B, 10] y", f"float[{batch}, 10] y")
    model = parser.parse_model(text)
    for node, name in zip(model.graph.node, ("fc1", "act", "fc2")):
        node.name = name
    for name, shape in (("w1", (24, 96)), ("b1", (96,)), ("w2", (96, 10)), ("b2", (10,))):
        model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=shape).astype(np.float32) / 5, name))
    if isinstance(batch, int):
        recipe = graph_recipe([{"name": "x", "shape": [batch, 24]}])
    else:
        recipe = graph_recipe([{"name": "x", "shape": ["B", 24]}], dims={"B": {"min": 1, "opt": 4, "max": 32}})
    return artifact_of(model, tmp_path / "in"), recipe, {"x": RNG.uniform(-1, 1, (24, 24)).astype(np.float32)}


def run_pass(source, recipe, arrays, workdir, **params) -> ModelArtifact:
    OpenVinoPass(OpenVinoParams(**params)).run(source, context(recipe, workdir, arrays))
    return ModelArtifact.open(workdir)


def test_int8_calibrates_a_model_whose_fixed_batch_is_above_one(tmp_path):
    # Input [3, 24]: calibration fed one sample at a time was refused by the IR ("got [1,24] expecting [3,24]").
    source, recipe, arrays = gemms(tmp_path, batch=3)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", guard=False)
    assert out.info["int8"]["quantizers"] == 2  # both Gemms' inputs
    assert out.info["int8"]["calibration_samples"] == 8  # 24 rows in batches of 3
    # Per CPU class: with AVX-512 the CPU plugin fuses this static-shape graph into one Snippets subgraph
    # it reports at f32, and the warning says so rather than claiming the model has no MatMul; held to
    # AVX2 (ONEDNN_MAX_CPU_ISA) it runs both as int8 layers (i8 and u8 inputs), and no warning is due.
    precisions, int8_names = out.info["compute_layer_precisions"], ("i8", "u8")
    assert out.info["ir_compute_ops"] == 2
    if precisions:
        assert sum(n for p, n in precisions.items() if p in int8_names) == 2 and openvino_int8_warning(out.info) is None
    else:
        assert "runs its 2 MatMul / Convolution ops inside fused subgraphs" in openvino_int8_warning(out.info)


def test_excluding_an_onnx_node_keeps_every_op_converted_from_it_in_float(tmp_path):
    source, recipe, arrays = gemms(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", exclude=["fc1"], guard=False)
    # fc1's MatMul ('fc1/WithoutBiases') stays f32, fc2's runs int8; before, only the Add named 'fc1' was excluded.
    assert out.info["compute_layer_precisions"].get("f32") == 1 and out.info["int8_layers"] == 1, out.info["compute_layer_precisions"]
    assert "fc1/WithoutBiases" in out.info["int8"]["options"]["ignored_scope"]


def test_an_exclude_name_that_matches_no_node_is_refused_with_the_node_names(tmp_path):
    source, recipe, arrays = gemms(tmp_path)
    with pytest.raises(RecipeError, match=r"stages.under-test.params.exclude: fc3 names no node .*its nodes: act, fc1, fc2"):
        run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", exclude=["fc1", "fc3"], guard=False)


def test_int8_only_params_on_an_fp32_stage_are_recorded_and_warned(tmp_path):
    source, recipe, arrays = gemms(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", exclude_types=["MatMul"], guard=False)
    assert out.info["ignored_params"] == ["exclude_types", "guard"]
    assert ignored_params_warning(out.info) == "exclude_types, guard apply only to precision int8; this fp32 stage ignored them"
    assert ignored_params_warning({"precision": "bf16", "ignored_params": ["subset_size"]}) == \
        "subset_size applies only to precision int8; this bf16 stage ignored it"
    plain = run_pass(source, recipe, arrays, tmp_path / "plain")
    assert "ignored_params" not in plain.info and ignored_params_warning(plain.info) is None


def unconvertible(tmp_path):
    """A model whose one op (Det) OpenVINO has no conversion rule for."""
    return artifact_of(parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 18]>
    det (float[N, 3, 3] x) => (float[N] y) {
      y = Det (x)
    }"""), tmp_path / "in")


def test_a_failed_conversion_leaves_the_root_logger_as_it_was(tmp_path):
    """openvino.convert_model left the root logger at ERROR after a failure: every later warning of
    the run was dropped (found when tests after an unconvertible model lost their warnings)."""
    import logging

    source = unconvertible(tmp_path)
    root = logging.getLogger()
    before = root.level, list(root.filters), list(root.handlers)
    with pytest.raises(Exception):
        ovr.convert_onnx(source.path)
    assert (root.level, root.filters, root.handlers) == before


def test_an_op_openvino_cannot_convert_is_named_in_the_one_line(tmp_path):
    source = unconvertible(tmp_path)
    recipe = graph_recipe([{"name": "x", "shape": ["N", 3, 3]}], dims={"N": {"min": 1, "opt": 2, "max": 4}})
    with pytest.raises(PassError) as caught:
        run_pass(source, recipe, {"x": RNG.normal(size=(4, 3, 3)).astype(np.float32)}, tmp_path / "ov")
    message = str(caught.value)
    assert "Det" in message and "failed at" not in message and "\n" not in message, message


def test_openvino_runtime_errors_keep_their_reason_not_the_cpp_location(tmp_path):
    source, _, _ = gemms(tmp_path, batch=3)
    compiled = ovr.compile_model(source.path, 1)
    with pytest.raises(Exception) as caught:
        ovr.runner(compiled)({"x": np.zeros((1, 24), np.float32)})
    assert first_line(caught.value).startswith("The input tensor size is not equal to the model input type: got [1,24] expecting [3,24]")


def test_the_guard_metric_breaks_while_top1_is_out_of_tolerance_though_the_cosine_holds():
    # Near-tied logits whose top two swap: cosine ~1, top-1 agreement 0. NNCF's accuracy control,
    # holding the cosine alone, stopped there with the stage out of tolerance.
    from optpipe.evaluation.accuracy import compare
    from optpipe.passes._openvino_guard import guard_metric
    from optpipe.recipe.schema import Tolerance

    reference = np.tile(np.array([[1.0, 0.999, 0.2, 0.1]], np.float32), (8, 1))
    swapped = reference[:, [1, 0, 2, 3]]
    tolerance = Tolerance(cosine_min=0.99, top1_min=0.9)
    inputs = {"x": RNG.normal(size=(8, 4)).astype(np.float32)}
    flipped = compare({"logits": swapped}, {"logits": reference}, inputs, tolerance, "input", True)
    assert flipped.worst_cosine > 0.999 and not flipped.within_tolerance
    assert guard_metric(flipped, 0.99) < 0.99  # a drop NNCF must repair
    same = compare({"logits": reference}, {"logits": reference}, inputs, tolerance, "input", True)
    assert guard_metric(same, 0.99) == same.worst_cosine


@pytest.mark.parametrize("params, message", [
    ({"platform": "openvino", "device": "gpu"}, "platform openvino runs on the CPU here"),
    ({"platform": "tensorrt", "device": "cpu"}, "platform tensorrt runs on GPUs only"),
])
def test_a_triton_device_its_platform_cannot_use_is_refused_at_validation(params, message):
    # It failed as a target after the whole run (exit 1); now validate names the key (exit 2).
    from optpipe.recipe.schema import TargetSpec
    from optpipe.targets import target_params

    with pytest.raises(RecipeError, match=rf"^targets.0.params: {message}"):
        target_params(TargetSpec(kind="triton", params=params), "targets.0.params")
    assert target_params(TargetSpec(kind="triton", params={"platform": "openvino"}), "targets.0.params").device == "auto"


def test_an_fp32_conversion_that_computes_something_else_is_refused_naming_the_ort_only_ops(tmp_path):
    # OpenVINO converts ONNX Runtime's contrib ops without error yet, for a BERT after the fuse pass
    # (MultiHeadAttention, SkipLayerNormalization, FusedGemm), computed cosine 0.69 in FP32: the int8
    # stage built on it read 'ok'. Here the input has a contrib op and the "conversion" is another model.
    from optpipe.passes.openvino import InputCheck, check_conversion

    model = parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (float[N, 24] x) => (float[N, 24] y) {
      y = com.microsoft.Gelu (x)
    }""")
    source = artifact_of_unchecked(model, tmp_path / "in")
    other = artifact_of(parser.parse_model(GEMMS.split("{")[0] .replace("float[B, 10] y", "float[B, 24] y") + "{ y = Neg (x) }"),
                        tmp_path / "other")
    recipe = graph_recipe([{"name": "x", "shape": ["N", 24]}], dims={"N": {"min": 1, "opt": 4, "max": 32}})
    arrays = {"x": RNG.uniform(-1, 1, (16, 24)).astype(np.float32)}
    check = InputCheck(source, context(recipe, tmp_path / "ov", arrays))
    with pytest.raises(PassError, match=r"^OpenVINO's FP32 conversion does not compute what the input ONNX does "
                                        r"\(output 'y' cosine .*its ONNX Runtime-only ops \(com.microsoft:Gelu\)"):
        check_conversion(ovr.convert_onnx(other.path), source, check)
    assert check_conversion(ovr.convert_onnx(source.path), source, check).within_tolerance  # its own conversion holds


def artifact_of_unchecked(model, folder):
    from optpipe.core.artifact import save_model

    return save_model(model, folder)  # onnx.checker does not know com.microsoft ops


def test_fused_attention_ops_make_the_graph_a_transformer(tmp_path):
    from optpipe.passes._openvino_nncf import has_attention

    model = parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (float[N, T, 32] q, float[N, T, 32] k, float[N, T, 32] v) => (float[N, T, 32] y) {
      y = com.microsoft.MultiHeadAttention <num_heads = 4> (q, k, v)
    }""")
    assert has_attention(artifact_of_unchecked(model, tmp_path / "mha"))
    source, _, _ = gemms(tmp_path)
    assert not has_attention(source)


def test_an_int8_openvino_stage_without_calibration_data_is_refused_at_validation():
    # It passed `optpipe validate` and failed at compile time, after its ancestors ran.
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.plan.validate import validate_recipe

    data = {"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}],
            "stages": {"export": {"pass": "export"}, "ov": {"pass": "openvino", "after": "export", "params": {"precision": "int8"}}}}
    with pytest.raises(RecipeError, match=r"^stages.ov: OpenVINO int8 \(NNCF\) calibrates on data, .* or set `params: \{precision: fp32\}`"):
        validate_recipe(parse_recipe(data))
    data["stages"]["ov"]["params"] = {"precision": "bf16"}
    validate_recipe(parse_recipe(data))  # fp32 / bf16 read no calibration data


def test_evaluation_data_that_cannot_fill_a_fixed_batch_is_the_datas_fault_not_an_internal_error(tmp_path):
    from optpipe.core.errors import DataError

    source, recipe, arrays = gemms(tmp_path, batch=3)
    arrays = {"x": arrays["x"][:10]}  # 10 samples, batches of 3
    with pytest.raises(DataError, match=r"^data.eval: 10 samples do not fill whole batches of the model's fixed batch 3"):
        run_pass(source, recipe, arrays, tmp_path / "ov")


def test_a_smooth_quant_alpha_nncf_ignores_on_a_model_without_attention_is_said(tmp_path):
    # NNCF runs SmoothQuant for its TRANSFORMER model type only: on this MLP the alpha gave the same bytes.
    source, recipe, arrays = gemms(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", guard=False, smooth_quant_alpha=0.5)
    assert ignored_params_warning(out.info) == \
        "smooth_quant_alpha applies only to model_type transformer; this int8 stage ignored it"


def test_an_int8_stage_on_a_broken_conversion_is_refused_before_any_node_is_excluded(tmp_path, monkeypatch):
    """The FP32 conversion is checked only when the int8 result breaks the tolerance (an int8 result
    within it vouches for the conversion); then, before NNCF's accuracy control tries to mend by
    excluding nodes what no exclusion can mend, and never an 'ok' stage."""
    from optpipe.passes import openvino as ov_pass

    source, recipe, arrays = gemms(tmp_path)
    wrong = ov_pass.ovr.convert_onnx(gemms(tmp_path / "other")[0].path)  # other weights: computes something else
    converted = []
    real = ov_pass.ovr.read_onnx  # the pass reads the ONNX with Core.read_model (memory-mapped weights)
    monkeypatch.setattr(ov_pass.ovr, "read_onnx", lambda path, **_: converted.append(path) or wrong)
    with pytest.raises(PassError, match=r"^OpenVINO's FP32 conversion does not compute what the input ONNX does"):
        run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8")
    monkeypatch.setattr(ov_pass.ovr, "read_onnx", real)
    held = run_pass(source, recipe, arrays, tmp_path / "ov-ok", precision="int8")
    assert held.info["int8"]["guard"]["held"] and [s["method"] for s in held.info["int8"]["guard"]["steps"]] == ["nncf.quantize"]


def test_a_bf16_stage_on_a_broken_conversion_is_refused_naming_the_conversion(tmp_path, monkeypatch):
    """bf16 checks its own result first (within tolerance, it vouches for the FP32 translation it is
    compiled from, as int8's does); a result that breaks it has its conversion checked: a broken one is
    refused as the conversion's fault, never an 'ok' or a bf16 stage merely out of tolerance."""
    from optpipe.passes import openvino as ov_pass

    if not ov_pass.ovr.supports("bf16"):
        pytest.skip("this CPU runs no bf16 in OpenVINO")
    source, recipe, arrays = gemms(tmp_path)
    wrong = ov_pass.ovr.convert_onnx(gemms(tmp_path / "other")[0].path)  # other weights: computes something else
    monkeypatch.setattr(ov_pass.ovr, "read_onnx", lambda path, **_: wrong)
    with pytest.raises(PassError, match=r"^OpenVINO's FP32 conversion does not compute what the input ONNX does"):
        run_pass(source, recipe, arrays, tmp_path / "ov", precision="bf16")


def near_tied_classifier(tmp_path):
    """Ten logits that share a bias of 20 and differ by ~0.1: int8's error flips their argmax while the cosine stays
    above 0.9999999 (a tiny Swin's ov-int8 read cosine 0.9966 and top-1 agreement 0.938 so)."""
    model = parser.parse_model(GEMMS.replace("float[B, 10] y", "float[B, 10] logits").replace("y = Gemm", "logits = Gemm"))
    for node, name in zip(model.graph.node, ("fc1", "act", "fc2")):
        node.name = name
    rng = np.random.default_rng(3)
    weights = (("w1", rng.normal(size=(24, 96)) / 5), ("b1", np.zeros(96)), ("w2", rng.normal(size=(96, 10)) / 50),
               ("b2", np.full(10, 20.0)))
    for name, array in weights:
        model.graph.initializer.append(numpy_helper.from_array(array.astype(np.float32), name))
    recipe = graph_recipe([{"name": "x", "shape": ["B", 24]}], dims={"B": {"min": 1, "opt": 4, "max": 32}})
    return artifact_of(model, tmp_path / "in"), recipe, {"x": rng.uniform(-1, 1, (64, 24)).astype(np.float32)}


def test_the_int8_guard_repairs_by_the_recipes_task_not_the_cosine_alone(tmp_path):
    # The guard had judged by the cosine alone: it kept plain int8, and the stage failed on its top-1 agreement after.
    from optpipe.recipe.schema import TaskSpec

    source, recipe, arrays = near_tied_classifier(tmp_path)
    recipe.evaluate.task = TaskSpec(kind="classification")
    guard = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8").info["int8"]["guard"]
    first = guard["steps"][0]
    assert first["method"] == "nncf.quantize" and first["cosine"] > 0.9999 and not first["held"]
    assert guard["held"] and len(guard["steps"]) > 1


def test_the_task_a_guard_judges_by_joins_the_stages_key(tmp_path):
    # A stage a guard decided under one task (or none) is not reused under another.
    from optpipe.evaluation.guard_types import guard_criteria
    from optpipe.recipe.schema import TaskSpec

    _, recipe, arrays = near_tied_classifier(tmp_path)
    plain = guard_criteria(context(recipe, tmp_path / "a", arrays))
    assert plain == {"tolerance": recipe.evaluate.tolerance.model_dump(mode="json")}  # keys without a task kept as they were
    recipe.evaluate.task = TaskSpec(kind="classification")
    assert guard_criteria(context(recipe, tmp_path / "b", arrays))["task"]["kind"] == "classification"


def test_the_int8_guard_keeps_convolutions_in_float_before_ranking_every_quantizer(tmp_path, monkeypatch):
    # Its cheap fix named MatMuls only: a CNN out of tolerance went straight to NNCF's accuracy control.
    from optpipe.passes import _openvino_guard as guard_module

    model = parser.parse_model("""
<ir_version: 9, opset_import: ["" : 17]>
cnn (float[B, 3, 16, 16] x) => (float[B, 4] y) {
  c = Conv <pads = [1, 1, 1, 1]> (x, w1)
  r = Relu (c)
  p = GlobalAveragePool (r)
  f = Flatten (p)
  y = MatMul (f, w2)
}
""")
    for node, name in zip(model.graph.node, ("conv", "act", "pool", "flat", "head")):
        node.name = name
    rng = np.random.default_rng(5)
    w1 = rng.normal(size=(16, 3, 3, 3)).astype(np.float32)
    w1[:, 0] = 0  # the model ignores input channel 0, whose range (below) crushes the others at the conv's int8 input
    model.graph.initializer.extend([numpy_helper.from_array(w1, "w1"),
                                    numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "w2")])
    source = artifact_of(model, tmp_path / "in")
    recipe = graph_recipe([{"name": "x", "shape": ["B", 3, 16, 16]}], dims={"B": {"min": 1, "opt": 4, "max": 32}},
                          tolerance={"cosine_min": 0.999})
    monkeypatch.setattr(guard_module, "_accuracy_control", lambda *a: pytest.fail("accuracy control before the cheap fix"))
    arrays = {"x": rng.uniform(-1, 1, (32, 3, 16, 16)).astype(np.float32)}
    arrays["x"][:, 0] *= 300
    guard = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", preset="mixed").info["int8"]["guard"]
    assert not guard["steps"][0]["held"], guard["steps"]
    assert guard["held"] and "Convolution" in guard["steps"][-1]["method"], guard["steps"]
