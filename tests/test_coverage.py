"""Coverage: every stage shows the precision it computes in; int8 after fuse on a CNN quantizes
the convolutions (FusedConv split back); a quantization stage left mostly in float warns;
`validate` catches the stage orders and missing data that cannot work, without a model run."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.errors import RecipeError
from optpipe.evaluation.verdict import stage_coverage
from optpipe.graph.coverage import precision_coverage, quantization_warning, unknown_shapes_warning
from optpipe.graph.unfuse import unfuse
from optpipe.passes import registry
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.plan.validate import validate_recipe

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
    from optpipe.core.results import StageResult

    stage = StageResult(name="int8", pass_name="int8", status="ok", coverage=coverage, warnings=warnings)
    text = render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
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


# --- com.microsoft quantized and fused ops: MACs split by where they run ------------------------

HIDDEN, SEQ, HEADS = 32, 24, 4
MS = "com.microsoft"


def _tensor(rng, shape, dtype, name):
    values = rng.integers(-100, 100, shape) if np.issubdtype(dtype, np.integer) else rng.normal(0, 0.1, shape)
    return numpy_helper.from_array(np.asarray(values, dtype), name)


def _model(nodes, inputs, outputs, inits, tmp_path, domains=(MS,)) -> onnx.ModelProto:
    """The model as a stage sees it: saved with its weights in external data, loaded without them."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(domain, 1) for domain in domains)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    return onnx.load(artifact_of(model, tmp_path / "m").path, load_external_data=False)


def qattention_layer(tmp_path) -> onnx.ModelProto:
    """What `export(attention: eager) -> fuse(transformer: ort) -> int8 dynamic` makes of a BERT layer:
    QAttention (packed int8 Q/K/V weight) and MatMulInteger for the output projection."""
    rng = np.random.default_rng(0)
    inits = [_tensor(rng, (HIDDEN, 3 * HIDDEN), np.int8, "wqkv"), _tensor(rng, (3 * HIDDEN,), np.float32, "bqkv"),
             numpy_helper.from_array(np.float32(0.01), "wqkv_scale"), numpy_helper.from_array(np.int8(0), "wqkv_zp"),
             _tensor(rng, (HIDDEN, HIDDEN), np.int8, "wo"), numpy_helper.from_array(np.int8(0), "wo_zp"),
             numpy_helper.from_array(np.float32(0.01), "wo_scale")]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"], name="quant_x"),
        helper.make_node("Mul", ["xs", "wqkv_scale"], ["qkv_scale"], name="scale_qkv"),
        helper.make_node("QAttention", ["xq", "wqkv", "bqkv", "xs", "wqkv_scale", "", "xzp", "wqkv_zp"], ["ctx"],
                         name="qattention", domain=MS, num_heads=HEADS),
        helper.make_node("DynamicQuantizeLinear", ["ctx"], ["cq", "cs", "czp"], name="quant_ctx"),
        helper.make_node("MatMulInteger", ["cq", "wo", "czp", "wo_zp"], ["o32"], name="out_proj"),
        helper.make_node("Cast", ["o32"], ["of"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["cs", "wo_scale"], ["os"], name="scale_o"),
        helper.make_node("Mul", ["of", "os"], ["y"], name="dequant"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])], inits, tmp_path)


def test_qattention_int8_share_is_its_projection(tmp_path):
    coverage = precision_coverage(qattention_layer(tmp_path), {"batch": 2, "sequence": SEQ})
    projection, out_proj = 2 * SEQ * HIDDEN * 3 * HIDDEN, 2 * SEQ * HIDDEN * HIDDEN
    scores_context = 2 * SEQ * SEQ * 2 * HIDDEN  # Q.K^T and P.V, both activations: float inside the kernel
    total = projection + out_proj + scores_context
    assert coverage.unknown_shapes == 0 and coverage.total_macs == total
    assert coverage.macs == {"int8": round((projection + out_proj) / total, 4), "fp32": round(scores_context / total, 4)}
    (core,) = coverage.float_compute
    assert core.op == "com.microsoft.QAttention" and core.nodes == 1 and "both operands are activations" in core.reason
    # Weights by stored type: the int8 Q/K/V and output weights, the fp32 Q/K/V bias.
    int8_weights, bias = 3 * HIDDEN * HIDDEN + HIDDEN * HIDDEN, 3 * HIDDEN
    assert coverage.weights == {"int8": round(int8_weights / (int8_weights + bias), 4), "fp32": round(bias / (int8_weights + bias), 4)}
    assert quantization_warning(coverage) is None


def test_fp32_attention_counts_all_float(tmp_path):
    rng = np.random.default_rng(1)
    inits = [_tensor(rng, (HIDDEN, 3 * HIDDEN), np.float32, "wqkv"), _tensor(rng, (3 * HIDDEN,), np.float32, "bqkv")]
    nodes = [helper.make_node("Attention", ["x", "wqkv", "bqkv"], ["y"], name="attention", domain=MS, num_heads=HEADS)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])], inits, tmp_path)
    coverage = precision_coverage(model, {"sequence": SEQ})
    projection, scores_context = SEQ * HIDDEN * 3 * HIDDEN, 2 * SEQ * SEQ * HIDDEN
    assert coverage.total_macs == projection + scores_context
    assert coverage.macs == {"fp32": 1.0} and coverage.weights == {"fp32": 1.0}
    reasons = {f.reason: f.mac_share for f in coverage.float_compute}
    assert reasons == {"not quantized": round(projection / coverage.total_macs, 4),
                       "attention scores and context: both operands are activations": round(scores_context / coverage.total_macs, 4)}


def test_a_matmul_reading_a_weight_cast_from_float16_is_said_to_need_an_fp32_start(tmp_path):
    """A float16 graph fused on ORT's CPU provider keeps its weights in float16 behind Casts; ORT's int8 quantizer
    sees no constant weight there. The reason says so (was: "both operands are activations"), and a MatMul of two
    activations beside it keeps that reason."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Cast", ["w16"], ["w"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="proj"),
             helper.make_node("MatMul", ["y", "xt"], ["scores"], name="scores")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["sequence", HIDDEN]),
                           helper.make_tensor_value_info("xt", TensorProto.FLOAT, [HIDDEN, "sequence"])],
                   [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["sequence", "sequence"])],
                   [_tensor(rng, (HIDDEN, HIDDEN), np.float16, "w16")], tmp_path, domains=())
    reasons = {f.reason for f in precision_coverage(model, {"sequence": SEQ}).float_compute}
    assert reasons == {"its weight is cast from a constant (a float16 graph?): ORT's quantizer reads float32 weights, "
                       "start from FP32", "both operands are activations (MatMulConstBOnly)"}


def test_quantized_contrib_matmuls_chain_their_shapes(tmp_path):
    """Each com.microsoft op feeds the next: a twin that lost a shape would leave every later node unknown.
    DynamicQuantizeMatMul, QGemm and MatMulIntegerToFloat compute in int8, FusedMatMul (transB) and
    a plain MatMul in fp32."""
    k, n, m, p, r, t = 8, 16, 24, 40, 48, 56
    rng = np.random.default_rng(2)
    scale, zp = (lambda name: numpy_helper.from_array(np.float32(0.02), name)), (lambda name: numpy_helper.from_array(np.int8(0), name))
    inits = [_tensor(rng, (k, n), np.int8, "w1"), scale("s1"), zp("z1"), _tensor(rng, (m, n), np.float32, "w2"),
             _tensor(rng, (m, p), np.int8, "w3"), scale("s3"), zp("z3"), _tensor(rng, (p, r), np.int8, "w4"), scale("s4"), zp("z4"),
             _tensor(rng, (r, t), np.float32, "w5")]
    nodes = [
        helper.make_node("DynamicQuantizeMatMul", ["x", "w1", "s1", "z1"], ["a"], name="dqmm", domain=MS),
        helper.make_node("FusedMatMul", ["a", "w2"], ["b"], name="fmm", domain=MS, transB=1, alpha=1.0),
        helper.make_node("DynamicQuantizeLinear", ["b"], ["bq", "bs", "bz"], name="qb"),
        helper.make_node("QGemm", ["bq", "bs", "bz", "w3", "s3", "z3"], ["c"], name="qgemm", domain=MS),
        helper.make_node("DynamicQuantizeLinear", ["c"], ["cq", "cs", "cz"], name="qc"),
        helper.make_node("MatMulIntegerToFloat", ["cq", "w4", "cs", "s4", "cz", "z4"], ["d"], name="mmitf", domain=MS),
        helper.make_node("Relu", ["d"], ["e"], name="relu"),
        helper.make_node("MatMul", ["e", "w5"], ["y"], name="head"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", t])], inits, tmp_path)
    coverage = precision_coverage(model, {"batch": 3})
    int8, fp32 = 3 * (k * n + m * p + p * r), 3 * (n * m + r * t)
    assert coverage.unknown_shapes == 0 and coverage.total_macs == int8 + fp32
    assert coverage.share("int8") == round(int8 / (int8 + fp32), 4)
    assert {f.op for f in coverage.float_compute} == {"com.microsoft.FusedMatMul", "MatMul"}


def test_unknown_shapes_are_reported_not_counted_as_zero(tmp_path):
    """An op no shape inference knows (here a custom domain's) hides the shape of the MatMul it feeds:
    the column and the warnings say so, instead of a mix computed as if that MatMul were free."""
    rng = np.random.default_rng(3)
    inits = [_tensor(rng, (HIDDEN, HIDDEN), np.float32, "w1"), _tensor(rng, (HIDDEN, HIDDEN), np.int8, "w2"), numpy_helper.from_array(np.int8(0), "z")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="known"),
             helper.make_node("Mystery", ["h"], ["m"], name="mystery", domain="com.example"),
             helper.make_node("DynamicQuantizeLinear", ["m"], ["mq", "ms", "mz"], name="q"),
             helper.make_node("MatMulInteger", ["mq", "w2", "mz", "z"], ["y"], name="unknown")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN])],
                   [helper.make_tensor_value_info("y", TensorProto.INT32, ["batch", HIDDEN])], inits, tmp_path, domains=("com.example",))
    coverage = precision_coverage(model, {"batch": 1})
    assert coverage.total_macs == HIDDEN * HIDDEN and coverage.unknown_ops == {"MatMulInteger": 1}
    assert coverage.summary() == "fp32 100% · 1 nodes' MACs unknown"
    warning = unknown_shapes_warning(coverage)
    assert "1 compute nodes not counted" in warning and "1 MatMulInteger" in warning
    # Nothing counted at all: the cell shows the weights' mix and says the MACs are unknown.
    del model.graph.node[0], model.graph.initializer[0]  # the known MatMul and its weight w1
    model.graph.node[0].input[0] = "x"
    only_unknown = precision_coverage(model, {"batch": 1})
    assert only_unknown.total_macs == 0 and only_unknown.summary() == "MACs unknown (1 nodes) · weights int8 100%"
    assert "shows the weights' mix" in unknown_shapes_warning(only_unknown)


def test_recurrent_ops_are_counted_and_ops_without_a_formula_are_not_free(tmp_path):
    """LSTM: sequence x batch x (W + R elements); an Einsum (no MAC formula) is reported, not counted as 0."""
    seq, batch, inp, hid = 7, 2, 12, 20
    rng = np.random.default_rng(4)
    inits = [_tensor(rng, (1, 4 * hid, inp), np.float32, "w"), _tensor(rng, (1, 4 * hid, hid), np.float32, "r"),
             _tensor(rng, (hid, hid), np.float32, "e")]
    nodes = [helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="lstm", hidden_size=hid),
             helper.make_node("Einsum", ["y", "e"], ["z"], name="einsum", equation="sdbh,hk->sdbk")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, inp])],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, [seq, 1, batch, hid])], inits, tmp_path, domains=())
    coverage = precision_coverage(model)
    assert coverage.total_macs == seq * batch * 4 * hid * (inp + hid) and coverage.macs == {"fp32": 1.0}
    assert coverage.unknown_ops == {"Einsum": 1} and "no MAC formula" in unknown_shapes_warning(coverage)


def test_the_mix_reads_largest_first_also_when_read_back_from_the_cache():
    from optpipe.graph.coverage import Coverage

    made = Coverage(macs={"int8": 0.8, "fp32": 0.2}, weights={"int8": 0.9, "fp32": 0.1}, total_macs=10, weight_elements=10)
    cached = Coverage.model_validate({**made.model_dump(), "macs": {"fp32": 0.2, "int8": 0.8}})  # the order JSON kept
    assert list(cached.macs) == ["fp32", "int8"]
    assert made.summary() == cached.summary() == "int8 80% · fp32 20%"


def test_an_lm_head_fused_with_its_transposed_embedding_is_counted_at_its_own_size(tmp_path):
    """GPT-2 after fuse: logits = FusedMatMul(hidden [1, 128, 64], embedding [500, 64], transB). ORT's
    symbolic inference (reached here through a SkipLayerNormalization) took the Einsum twin to a
    [500, 128, 500] output: 2e9 MACs for a 12e6-MAC model, and 'fp32 100%' for an int8 stage."""
    batch, seq, hidden, vocab = 1, 128, 64, 500
    rng = np.random.default_rng(4)
    inits = [_tensor(rng, (vocab, hidden), np.float32, "wte"), _tensor(rng, (hidden,), np.float32, "gamma"),
             _tensor(rng, (hidden,), np.float32, "beta")]
    nodes = [helper.make_node("SkipLayerNormalization", ["x", "x", "gamma", "beta"], ["h"], name="ln", domain=MS),
             helper.make_node("FusedMatMul", ["h", "wte"], ["logits"], name="head", domain=MS, transB=1, alpha=1.0)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", hidden])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])], inits, tmp_path)
    coverage = precision_coverage(model, {"batch": batch, "sequence": seq})
    assert coverage.unknown_shapes == 0 and coverage.total_macs == batch * seq * hidden * vocab


def test_an_accuracy_warning_flags_the_accuracy_cell_not_the_precision_cell(cnn_setup):
    # "fp32 100% ⚠" on a model that ignores its inputs pointed the user at the precision column.
    tmp, recipe, images, exported, _, passes = cnn_setup
    coverage, _ = stage_coverage(exported, {"batch": 1}, "simplify")
    from optpipe.core.results import Accuracy, OutputAccuracy, StageResult
    from optpipe.reporting.run_report import build_report, render_markdown

    output = OutputAccuracy(name="logits", max_abs=0.0, mean_abs=0.0, cosine_mean=1.0, cosine_min=1.0, input_sensitivity=1e-4)
    meaningless = "the reference's outputs barely change ...: so these accuracy figures mean nothing"
    accuracy = Accuracy(reference="export", samples=4, outputs=[output], within_tolerance=True, warnings=[meaningless])
    stage = StageResult(name="simplify", pass_name="simplify", status="ok", coverage=coverage, accuracy=accuracy,
                        warnings=[meaningless])
    text = render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
    assert "fp32 100% |" in text and "fp32 100% ⚠" not in text
