"""Weight-only quantization: ORT MatMulNBits (int4/int8, block size, symmetric or not, accuracy
level) and NNCF compress_weights (OpenVINO IR), on tiny MLPs built here; the precision column
counts 4-bit weights as int4 by their real (packed) bytes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers_decoders import skip_compressed_under_isa_restriction
from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.errors import PassError
from optpipe.execution.stage_runner import run_checked
from optpipe.graph.coverage import precision_coverage
from optpipe.passes import get_pass

K, H, N = 128, 256, 64


def mlp(seed: int, k: int = K, hidden: int = H, n: int = N) -> onnx.ModelProto:
    """x[batch, k] -> MatMul mm1 -> Relu -> MatMul mm2 -> y, plus an activation x activation MatMul
    (y . y^T, like attention scores) that no weight-only quantizer may touch."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        helper.make_node("Transpose", ["y"], ["yt"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["y", "yt"], ["scores"], name="scores"),
    ]
    inits = [numpy_helper.from_array(rng.normal(0, k ** -0.5, (k, hidden)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, hidden ** -0.5, (hidden, n)).astype(np.float32), "w2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", "batch"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weight_only")
    source = artifact_of(mlp(3), tmp / "source")
    recipe = graph_recipe([{"name": "x", "shape": ["batch", K]}], {"batch": {"min": 1, "opt": 1, "max": 8}})
    feeds = {"x": np.random.default_rng(4).normal(size=(16, K)).astype(np.float32)}
    return tmp, source, recipe, feeds, run_model(source.path, feeds)[0]


def _run(setup, name: str, label: str, **params):
    tmp, source, recipe, feeds, _ = setup
    cls = get_pass(name)
    return run_checked(cls(cls.Params(**params)), source, context(recipe, tmp / label, feeds))


def _worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


# Measured on this MLP (Gaussian weights, 16 samples): int4 block 32 worst row cosine 0.991 (sym)
# / 0.992 (asym), int8 0.99993; the bounds leave room for other seeds and ISAs, and still fail a
# wrong dequantization (a sign or scale error gives cosine < 0.5).
@pytest.mark.parametrize("params, cosine_min", [
    ({"bits": 4, "block_size": 32}, 0.98),
    ({"bits": 4, "block_size": 64, "symmetric": False, "accuracy_level": 1}, 0.98),
    ({"bits": 8, "block_size": 32}, 0.999),
])
def test_matmulnbits_quantizes_weights_not_activations(setup, params, cosine_min):
    tmp, source, _, feeds, reference = setup
    out = _run(setup, "weight_only", "ort-%d-%d" % (params["bits"], params["block_size"]), **params)
    graph = out.load(with_weights=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert sorted(n.name for n in nbits) == ["mm1_Q%d" % params["bits"], "mm2_Q%d" % params["bits"]]
    assert {a.name: helper.get_attribute_value(a) for a in nbits[0].attribute}["block_size"] == params["block_size"]
    assert [n.name for n in graph.node if n.op_type == "MatMul"] == ["scores"]
    assert out.info["left_in_float"] == [{"node": "scores", "reason": "both operands are activations (attention scores / context)"}]
    assert _worst_cosine(run_model(out.path, feeds)[0], reference) >= cosine_min
    # The weights shrink by about 32/bits (plus scales); the precision column says int4 / int8.
    float_bytes = (K * H + H * N) * 4
    packed = out.info["coverage"]["weight_bytes"]
    assert float_bytes / packed > {4: 5.0, 8: 3.0}[params["bits"]]
    precision = "int%d" % params["bits"]
    assert out.info["coverage"]["weights"] == {precision: 1.0} and out.info["coverage"]["bytes"] == {precision: 1.0}


def _run_proto(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def gemm_mlp(seed: int) -> onnx.ModelProto:
    """As the dynamo exporter writes torch.addmm (GPT-2's Conv1D): Gemm with constant weights, one plain with a bias,
    one with transB, alpha and beta; plus a Gemm of two activations that stays."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "c1"], ["h"], name="g1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2t", "c2"], ["y"], name="g2", transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Gemm", ["y", "y"], ["scores"], name="scores", transB=1),
    ]
    inits = [numpy_helper.from_array(rng.normal(0, K ** -0.5, (K, H)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.1, H).astype(np.float32), "c1"),
             numpy_helper.from_array(rng.normal(0, H ** -0.5, (N, H)).astype(np.float32), "w2t"),
             numpy_helper.from_array(rng.normal(0, 0.1, N).astype(np.float32), "c2")]
    graph = helper.make_graph(nodes, "gemm_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", "batch"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_gemm_weights_are_rewritten_as_matmuls_and_quantized(setup):
    """Gemm -> MatMul (+ Add): the same outputs in float, then MatMulNBits takes them (the GPT-2 export had
    only Gemms, and weight_only found nothing to quantize)."""
    from optpipe.graph.matmul_weights import gemms_as_matmuls

    tmp, _, recipe, feeds, _ = setup
    model = gemm_mlp(5)
    expected = _run_proto(model, feeds)
    rewritten = gemm_mlp(5)
    assert gemms_as_matmuls(rewritten) == 2
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Gemm") == 1  # the activation x activation Gemm stays
    assert "w2t" not in {i.name for i in rewritten.graph.initializer}  # its transposed copy replaced it
    for a, b in zip(_run_proto(rewritten, feeds), expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    cls = get_pass("weight_only")
    out = run_checked(cls(cls.Params(bits=8, block_size=32)), artifact_of(model, tmp / "gemm-source"),
                      context(recipe, tmp / "gemm-int8", feeds))
    assert out.info["gemms_as_matmuls"] == 2 and out.info["quantized"] == 2
    y = run_model(out.path, feeds)[0]
    assert _worst_cosine(y, expected[0]) > 0.999  # int8 blocks of 32 (measured 0.99994)


def test_a_tied_head_read_through_a_transpose_is_quantized(setup):
    """A tied LM head multiplies by the embedding table through a Transpose (Gemma's 63% of MACs stayed FP32):
    the transposed table becomes the head's own weight and is quantized; the Gather keeps the table. Excluded,
    the head is left as it was (no FP32 copy of the table added)."""
    tmp, _, recipe, feeds, _ = setup
    rng = np.random.default_rng(6)
    table = rng.normal(0, K ** -0.5, (N, K)).astype(np.float32)  # [vocab, hidden]
    nodes = [helper.make_node("MatMul", ["x", "proj_w"], ["h"], name="proj"),
             helper.make_node("Transpose", ["table"], ["table_t"], name="tie", perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"], name="lm_head"),
             helper.make_node("ArgMax", ["logits"], ["ids"], name="argmax", axis=1, keepdims=0),
             helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", N]),
                               helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["batch", K])],
                              [numpy_helper.from_array(table, "table"),
                               numpy_helper.from_array(rng.normal(0, K ** -0.5, (K, K)).astype(np.float32), "proj_w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    source = artifact_of(model, tmp / "tied-source")
    expected = run_model(source.path, feeds)
    cls = get_pass("weight_only")

    out = run_checked(cls(cls.Params(bits=8, block_size=32)), source, context(recipe, tmp / "tied-int8", feeds))
    assert out.info["transposed_weights"] == ["lm_head"] and out.info["quantized"] == 2
    ops = [n.op_type for n in out.load(with_weights=False).graph.node]
    assert "Transpose" not in ops and ops.count("MatMulNBits") == 2 and "Gather" in ops
    logits = run_model(out.path, feeds)[0]
    assert _worst_cosine(logits, expected[0]) > 0.999  # int8 blocks of 32, both MatMuls (measured 0.99990)

    kept = run_checked(cls(cls.Params(bits=8, block_size=32, exclude=["lm_head"])), source, context(recipe, tmp / "tied-kept", feeds))
    graph = kept.load(with_weights=False).graph
    assert kept.info["transposed_weights"] == [] and kept.info["quantized"] == 1
    assert "table" in {i.name for i in graph.initializer} and not any("transposed" in i.name for i in graph.initializer)
    assert [n.op_type for n in graph.node].count("Transpose") == 1


def test_coverage_counts_packed_weights_as_what_they_stand_for(setup):
    """An excluded MatMul stays fp32: weights (elements) are int4 K*H vs fp32 H*N, and bytes weigh
    the 4-bit ones at about half a byte each (the old count read the packed uint8 as one int8 each)."""
    out = _run(setup, "weight_only", "ort-exclude", exclude=["mm2"])
    coverage = precision_coverage(out.load(with_weights=False), {"batch": 1})
    assert coverage.weights["int4"] == pytest.approx(K * H / (K * H + H * N), abs=1e-3)
    int4_bytes = coverage.bytes["int4"] * coverage.weight_bytes
    assert K * H / 2 <= int4_bytes <= K * H / 2 * 1.3  # packed nibbles plus one fp32 scale per 32
    assert coverage.macs["int4"] == pytest.approx(K * H / (K * H + H * N + N), abs=0.01)
    assert out.info["left_in_float"][0] == {"node": "mm2", "reason": "listed in exclude"}


def test_weight_only_refusals_name_the_fix(setup):
    with pytest.raises(PassError, match="exclude names nodes"):
        _run(setup, "weight_only", "bad-name", exclude=["nope"])
    with pytest.raises(ValueError, match="symmetric: false"):
        get_pass("weight_only").Params(algorithm="hqq")
    with pytest.raises(ValueError, match="power of two"):
        get_pass("weight_only").Params(block_size=48)


@pytest.mark.parametrize("mode, precision", [("int4_sym", "int4"), ("int8_asym", "int8")])
def test_nncf_compress_weights_writes_an_ir_with_compressed_weights(setup, mode, precision):
    from optpipe.evaluation import openvino_runtime as ovr
    skip_compressed_under_isa_restriction()

    tmp, source, _, feeds, reference = setup
    params = {"mode": mode, "group_size": 32, "all_layers": True} if mode.startswith("int4") else {"mode": mode}
    out = _run(setup, "openvino_weights", "ov-" + mode, **params)
    assert ovr.is_ir(out.folder)
    assert out.info["coverage"]["macs"] == {precision: 1.0}
    assert out.info["options"]["mode"] == mode.upper()
    compiled = ovr.compile_model(out.folder / ovr.IR_FILE, 1)
    y = compiled(feeds)[compiled.outputs[0]]
    assert _worst_cosine(y, reference) >= (0.98 if precision == "int4" else 0.999)


@pytest.mark.parametrize("params, said", [
    ({"mode": "int8_sym", "group_size": 64}, "group_size apply to int4 modes only"),
    ({"awq": True}, "awq needs activations: set `data_aware: true`"),
    ({"gptq": True}, "gptq needs activations"),
    ({"ratio": 0.5, "sensitivity_metric": "hessian"}, "sensitivity_metric hessian .* or use `weight_error`"),
    ({"data_aware": True, "lora_correction": True, "all_layers": True}, "set `all_layers: false`"),
    ({"data_aware": True, "gptq": True, "lora_correction": True}, "keep one"),
    ({"mode": "int8_asym", "backup_mode": "none"}, "backup_mode apply to int4 modes only"),
    ({"group_size": 0}, "group_size 0 is not a group"),
])
def test_nncf_refusals_name_the_fix_at_recipe_read(params, said):
    """Options NNCF refuses or ignores together are a recipe error (exit 2, one line naming the stage), before any stage runs."""
    from types import SimpleNamespace

    from optpipe.core.errors import RecipeError
    from optpipe.plan.validate import configure

    cls = get_pass("openvino_weights")
    with pytest.raises(RecipeError, match=said) as caught:
        configure("ov", SimpleNamespace(pass_name="openvino_weights", params=params), {"openvino_weights": cls})
    assert str(caught.value).startswith("stages.ov.params") and "\n" not in str(caught.value)


def test_memory_preflight_names_the_stage_that_will_not_fit():
    from optpipe.core.errors import UserInputError
    from optpipe.safety.memory_estimate import check_fits, stage_estimates

    stages = {"export": "export", "int4": "weight_only", "ov": "openvino_weights"}
    gb = 10 ** 9
    estimates = stage_estimates(4 * gb, stages)
    assert estimates["int4"] < estimates["export"]
    assert check_fits(4 * gb, stages, available=40 * gb) == estimates
    with pytest.raises(UserInputError, match="stage 'export' \\(export\\) needs about 9.6 GB .* 6.3 GB is available"):
        check_fits(4 * gb, stages, available=7 * gb)
    # The torch model the run holds for the eager rows: beside every stage after the export, not twice in it.
    held = stage_estimates(4 * gb, stages, held=4 * gb)
    assert held["export"] == estimates["export"] and held["int4"] == estimates["int4"] + 4 * gb
    with pytest.raises(UserInputError, match="stage 'int4' \\(weight_only\\)"):
        check_fits(4 * gb, stages, available=int(held["export"] / 0.9) + 1, held=4 * gb)


def test_memory_preflight_takes_nncf_data_aware_compression_as_its_own_step(tmp_path):
    """NNCF's data-aware compression runs a compiled FP32 model beside the one it compresses: the preflight
    estimates it above the data-free stage (measured 2.23x against 1.43x the weights on Gemma 3 270M)."""
    import yaml

    from optpipe.plan.source_preflight import estimated_steps
    from optpipe.safety.memory_estimate import OV_DATA_AWARE, stage_estimates
    from optpipe.safety.recipe_loading import parse_recipe
    from test_generation_report import decoder_recipe

    stages = {"export": {"pass": "export"},
              "ov": {"pass": "openvino_weights", "after": "export", "params": {"mode": "int4_sym"}},
              "ov_data": {"pass": "openvino_weights", "after": "export", "params": {"mode": "int4_asym", "data_aware": True}}}
    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path, stages=stages).read_text()))
    steps = estimated_steps(recipe, 1 << 30)
    assert steps["ov"] == "openvino_weights" and steps["ov_data"] == OV_DATA_AWARE
    estimates = stage_estimates(1 << 30, steps)
    # At least the measured 2.23x above the baseline: the estimate must not let a model through that then runs out.
    assert estimates["ov_data"] > estimates["ov"] and estimates["ov_data"] >= 350 * 2 ** 20 + 2.23 * 2 ** 30


def test_memory_preflight_estimates_the_torchscript_exporter_and_openvino_int8_at_their_own_peaks(tmp_path):
    """The TorchScript exporter holds the torch model, its constant-folded weights and the serialized graph at once
    (BERT-large: 3.5x the weights above the baseline, against the dynamo export's 2.3x that `auto` tries first);
    OpenVINO int8, NNCF's statistics model and SmoothQuant's copies (4.2x, against the passes' 2.0x floor)."""
    from optpipe.plan.source_preflight import stage_steps
    from optpipe.safety.memory_estimate import OV_INT8, TORCHSCRIPT_EXPORT, stage_estimates
    from optpipe.safety.recipe_loading import parse_recipe

    recipe = parse_recipe({
        "model": {"hf_config": {"model_type": "bert"}}, "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 8]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 2}},
        "stages": {"ts": {"pass": "export", "params": {"exporter": "torchscript"}}, "auto": {"pass": "export"},
                   "ov8": {"pass": "openvino", "after": "auto", "params": {"precision": "int8"}},
                   "ov32": {"pass": "openvino", "after": "auto"}}})
    steps = stage_steps(recipe, 1 << 30)
    assert steps == {"ts": TORCHSCRIPT_EXPORT, "auto": "export", "ov8": OV_INT8, "ov32": "openvino"}
    estimates = stage_estimates(1 << 30, steps)
    assert estimates["ts"] >= 350 * 2 ** 20 + 3.5 * 2 ** 30 > estimates["auto"]
    assert estimates["ov8"] >= 350 * 2 ** 20 + 4.2 * 2 ** 30 and estimates["ov32"] >= 350 * 2 ** 20 + 2.1 * 2 ** 30


def test_memory_preflight_adds_the_tied_table_weight_only_transposes(tmp_path):
    """A model whose LM head shares the embedding table: weight_only with HQQ writes the table transposed for the
    head, and the preflight adds that transient to its stages (none where the head has its own weights, nor for
    the default algorithm, which quantizes the head from the table's rows)."""
    import yaml

    from optpipe.plan.source_preflight import estimated_steps
    from optpipe.safety.memory_estimate import TIED_TABLE_FACTOR, WEIGHT_ONLY_COPY, WEIGHT_ONLY_WORKER, stage_estimates
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source.torch_weights import tied_table_bytes
    from test_generation_report import LLAMA, decoder_recipe

    untied = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path).read_text()))
    assert tied_table_bytes(untied.model_source()) == 0
    tied = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path, model={"hf_config": {**LLAMA, "tie_word_embeddings": True},
                                                                          "task": "causal-lm", "outputs": ["logits"]}).read_text()))
    table = tied_table_bytes(tied.model_source())
    assert table == 4 * LLAMA["vocab_size"] * LLAMA["hidden_size"]
    # The same tied config as an encoder (no LM head: a BERT, whose config says tied by transformers' default).
    encoder = yaml.safe_load(decoder_recipe(tmp_path, model={"hf_config": {**LLAMA, "tie_word_embeddings": True},
                                                             "task": "feature-extraction"}).read_text())
    encoder["evaluate"].pop("generation")
    assert tied_table_bytes(parse_recipe(encoder).model_source()) == 0
    steps = {"export": "export", "int4": WEIGHT_ONLY_COPY, "int8": WEIGHT_ONLY_WORKER}
    plain, with_table = stage_estimates(1 << 30, steps), stage_estimates(1 << 30, steps, tied_table=table)
    assert with_table["int4"] == plain["int4"] + int(TIED_TABLE_FACTOR * table) and with_table["export"] == plain["export"]
    assert with_table["int8"] == plain["int8"]

    stages = {"export": {"pass": "export"},
              "int4": {"pass": "weight_only", "after": "export", "params": {"bits": 4}},
              "hqq": {"pass": "weight_only", "after": "export", "params": {"algorithm": "hqq", "symmetric": False}}}
    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path, stages=stages).read_text()))
    big, small = estimated_steps(recipe, 1 << 30), estimated_steps(recipe, 100 << 20)
    assert (big["int4"], big["hqq"]) == (WEIGHT_ONLY_WORKER, WEIGHT_ONLY_COPY)  # from 256 MB the pass runs its worker
    assert (small["int4"], small["hqq"]) == ("weight_only", WEIGHT_ONLY_COPY)


def test_nncf_data_aware_reads_the_calibration_set_and_the_column_shows_the_mix(setup):
    """scale_estimation reads activations (data.calibration); with a ratio NNCF keeps layers in int8
    (on this 2-layer MLP it kept both, measured): the column reports NNCF's choice, not the request."""
    out = _run(setup, "openvino_weights", "ov-data", mode="int4_asym", group_size=32, all_layers=True,
               data_aware=True, scale_estimation=True, subset_size=8)
    assert out.info["coverage"]["macs"] == {"int4": 1.0}
    assert out.info["options"]["scale_estimation"] is True
    mixed = _run(setup, "openvino_weights", "ov-ratio", mode="int4_sym", group_size=32, all_layers=True, ratio=0.5,
                 data_aware=True, subset_size=8)
    assert mixed.info["coverage"]["macs"].get("int8", 0) > 0


@pytest.mark.parametrize("option", ["gptq", "lora_correction"])
def test_nncf_gptq_and_lora_correction_run_on_the_calibration_set(setup, option):
    """GPTQ rewrites the 4-bit weights column by column; LoRA correction adds low-rank float adapters
    (MatMuls beside each 4-bit layer). Both are told to NNCF, recorded, and stay close to the float model."""
    from optpipe.evaluation import openvino_runtime as ovr

    skip_compressed_under_isa_restriction()  # they ran natively on x86-avx2 (stop 28) and x86-avx512-vnni
    _, _, _, feeds, reference = setup
    out = _run(setup, "openvino_weights", "ov-" + option, mode="int4_asym", group_size=32, all_layers=option == "gptq",
               data_aware=True, subset_size=8, **{option: True})
    assert out.info["options"][option] is True and out.info["coverage"]["macs"].get("int4", 0) > 0.5
    compiled = ovr.compile_model(out.folder / ovr.IR_FILE, 1)
    assert _worst_cosine(compiled(feeds)[compiled.outputs[0]], reference) >= 0.98


def test_nncf_backup_mode_none_keeps_the_other_layers_in_float(setup):
    out = _run(setup, "openvino_weights", "ov-backup-none", mode="int4_sym", group_size=32, ratio=0.5,
               backup_mode="none")
    assert out.info["options"]["backup_mode"] == "NONE"
    assert "int8" not in out.info["coverage"]["macs"]


def test_nncf_data_aware_calibrates_a_kv_cache_decoder_on_token_ids_alone(tmp_path):
    """A decoder exported with its KV cache takes a mask and a past per layer beside the tokens; the
    calibration set (a text source) has only input_ids. Each sample is fed as its prefill (a mask of
    ones, an empty past): AWQ and scale estimation run, and the IR still generates."""
    from helpers_decoders import PROMPT, tiny_llama
    from optpipe.evaluation import generation as gen
    from optpipe.source.decoder_export import export_decoder

    skip_compressed_under_isa_restriction()
    layout = export_decoder(tiny_llama(), tmp_path / "onnx", max_batch=2, max_sequence=16, max_past=40)
    recipe = graph_recipe([{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 256]}],
                          {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 2, "opt": 8, "max": 16}})
    tokens = {"input_ids": np.random.default_rng(5).integers(0, 256, (8, 8)).astype(np.int64)}
    cls = get_pass("openvino_weights")
    params = cls.Params(mode="int4_asym", group_size=32, all_layers=True, data_aware=True, awq=True,
                        scale_estimation=True, subset_size=8)
    source = artifact_of(onnx.load(str(tmp_path / "onnx" / "model.onnx")), tmp_path / "source")
    out = run_checked(cls(params), source, context(recipe, tmp_path / "ov", tokens))
    assert out.info["options"]["awq"] is True and out.info["coverage"]["macs"].get("int4", 0) > 0.5
    from optpipe.evaluation import openvino_runtime as ovr

    tokens_out = gen.greedy(gen.OpenVinoRunner(tmp_path / "ov" / ovr.IR_FILE, layout, 1), layout, PROMPT, 4).tokens
    assert tokens_out.shape == (2, 4)


def test_weight_layout_for_gptq_keeps_the_product_and_the_names(setup):
    """NNCF's GPTQ takes MatMul weights stored [out, in]; the ONNX frontend gives [in, out]. The rewrite
    transposes each constant weight (not the activation x activation MatMul) and changes nothing else."""
    from optpipe.evaluation import openvino_runtime as ovr
    from optpipe.passes._ov_weight_layout import weights_out_in

    _, source, _, feeds, _ = setup
    model = ovr.read_onnx(source.path)
    before = ovr.compile_model(model.clone(), 1)(feeds)
    assert weights_out_in(model) == 2
    matmuls = {n.get_friendly_name(): n.get_attributes()["transpose_b"] for n in model.get_ordered_ops() if n.get_type_name() == "MatMul"}
    assert sum(matmuls.values()) == 2 and len(matmuls) == 3 and weights_out_in(model) == 0
    after = ovr.compile_model(model, 1)(feeds)
    for a, b in zip(before.values(), after.values()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _rss_file_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


def test_nncf_compression_reads_weights_unmapped(setup, tmp_path, monkeypatch):
    """The openvino_weights pass reads the ONNX without OpenVINO's memory map: NNCF replaces the weights it
    compresses, and a mapped page, once read, stays resident while any weight of the file lives (Gemma 3
    270M's data-aware INT4 peaked 0.39 GB higher mapped). Here: 128 MB of weights compressed to INT4 leave
    about their size of file pages resident when mapped, and none when not; and the pass asks for no map."""
    import nncf

    from optpipe.evaluation import openvino_runtime as ovr

    rng = np.random.default_rng(0)
    nodes, inits, width = [], [], 2048
    for i in range(4):  # 4 x 2048 x 4096 float32: 128 MB, in model.onnx.data, each with a float bias NNCF keeps
        w = rng.normal(0, 0.02, (width, 2 * width) if i % 2 == 0 else (2 * width, width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.full(w.shape[1], 0.1, np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i + 1}"], name=f"bias{i}")]
    graph = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("h4", TensorProto.FLOAT, ["batch", width])], inits)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path,
              save_as_external_data=True, location="model.onnx.data")
    weights = 4 * width * 2 * width * 4

    def resident_after_compression(mmap: bool) -> int:
        before = _rss_file_bytes()
        model = ovr.read_onnx(path, mmap=mmap)
        compressed = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=64, all_layers=True)
        grown = _rss_file_bytes() - before
        del model, compressed
        return grown

    # Measured: 128 MB mapped and 0 MB unmapped (x86-amx, OpenVINO 2026.4, NNCF 3.4).
    assert resident_after_compression(True) > weights / 2
    assert resident_after_compression(False) < weights / 8

    asked = []
    real = ovr.read_onnx
    monkeypatch.setattr(ovr, "read_onnx", lambda p, mmap=True: asked.append(mmap) or real(p, mmap=mmap))
    _run(setup, "openvino_weights", "ov-unmapped", mode="int4_sym", group_size=32)
    assert asked == [False]
