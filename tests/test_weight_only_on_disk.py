"""weight_only without the float weights in memory (issue 20): the tied head quantized from the table's rows a slice
at a time, and the quantizer in a worker that reads the weights from disk, each against ORT's own quantizer on the
loaded model, byte for byte (passes/_tied_head_nbits.py, passes/_weight_only_on_disk.py)."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.errors import PassError
from optpipe.execution.stage_runner import run_checked
from optpipe.graph.matmul_weights import gemms_as_matmuls, tied_heads, transposed_weights_folded
from optpipe.passes import _tied_head_nbits, _weight_only_on_disk, get_pass
from optpipe.passes._disk_worker import graph_with_small_tensors
from optpipe.passes._nbits_quantize import quantize, quantize_weights
from optpipe.passes.weight_only import WeightOnlyParams

K, VOCAB = 64, 300  # a vocabulary that no slice size divides: the last slice is short

LOG = logging.getLogger("test")


def tied_model(seed: int = 0) -> onnx.ModelProto:
    """x -> Gemm(transB) -> MatMul -> tied head (MatMul of Transpose(table)) -> logits; Gather reads the table too."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0, K ** -0.5, (VOCAB, K)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "gemm_w", "gemm_b"], ["g"], name="gemm", transB=1),
             helper.make_node("MatMul", ["g", "proj_w"], ["h"], name="proj"),
             helper.make_node("Transpose", ["table"], ["table_t"], name="tie", perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"], name="lm_head"),
             helper.make_node("ArgMax", ["logits"], ["ids"], name="argmax", axis=1, keepdims=0),
             helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed")]
    inits = [numpy_helper.from_array(table, "table"),
             numpy_helper.from_array(rng.normal(0, K ** -0.5, (K, K)).astype(np.float32), "gemm_w"),
             numpy_helper.from_array(rng.normal(0, 0.1, K).astype(np.float32), "gemm_b"),
             numpy_helper.from_array(rng.normal(0, K ** -0.5, (K, K)).astype(np.float32), "proj_w")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", VOCAB]),
                               helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["batch", K])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _recipe():
    return graph_recipe([{"name": "x", "shape": ["batch", K]}], {"batch": {"min": 1, "opt": 1, "max": 4}})


def _by_ort_on_a_float_copy(model: onnx.ModelProto, params: WeightOnlyParams) -> onnx.ModelProto:
    """What the pass wrote before: the transposed table as a float initializer, then ORT's quantizer on all of it."""
    gemms_as_matmuls(model)
    transposed_weights_folded(model, skip=frozenset(params.exclude))
    return quantize(model, params, LOG)[0]


def _same(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
    assert [_tensor(i) for i in a.graph.initializer] == [_tensor(i) for i in b.graph.initializer]
    assert sorted((o.domain, o.version) for o in a.opset_import) == sorted((o.domain, o.version) for o in b.opset_import)


def _tensor(tensor: onnx.TensorProto) -> tuple:
    """Name, type, dims and bytes (a weight loaded from a file says data_location DEFAULT where a new one is silent)."""
    return tensor.name, tensor.data_type, list(tensor.dims), numpy_helper.to_array(tensor).tobytes()


PARAMS = [{"bits": 4, "block_size": 32}, {"bits": 4, "block_size": 16, "symmetric": False, "accuracy_level": 1},
          {"bits": 8, "block_size": 32, "symmetric": False}]


@pytest.mark.parametrize("params", PARAMS)
def test_the_tied_head_quantized_in_slices_is_ort_quantizers_own_result(params, tmp_path, monkeypatch):
    """Slices of 7 rows (43 slices, the last of 6), from the loaded table and from its external-data file: the
    same packed weights, scales, zero points, node and names as ORT's quantizer on the whole transposed copy."""
    monkeypatch.setattr(_tied_head_nbits, "SLICE_BYTES", 7 * K * 4)
    params = WeightOnlyParams(**params)
    expected = _by_ort_on_a_float_copy(tied_model(), params)
    assert any(n.op_type == "MatMulNBits" and n.name == "lm_head_Q%d" % params.bits for n in expected.graph.node)

    in_memory, facts = quantize_weights(tied_model(), params, LOG, tmp_path)
    _same(in_memory, expected)
    assert facts["transposed_weights"] == ["lm_head"] and facts["candidates"] == 3 and facts["gemms_as_matmuls"] == 1

    path = artifact_of(tied_model(), tmp_path / "source").path
    on_disk = graph_with_small_tensors(path, small_bytes=0)  # every weight left in the file
    table = next(t for t in on_disk.graph.initializer if t.name == "table")
    assert onnx.external_data_helper.uses_external_data(table)
    on_disk = onnx.load(str(path))
    for tensor in on_disk.graph.initializer:  # the rest loaded, only the table read from the file in slices
        if tensor.name == "table":
            tensor.CopyFrom(table)
    quantized, _ = quantize_weights(on_disk, params, LOG, path.parent)
    onnx.external_data_helper.load_external_data_for_model(quantized, str(path.parent))
    _same(quantized, expected)


def _half(model: onnx.ModelProto) -> onnx.ModelProto:
    for tensor in model.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[2]])
def test_a_float16_table_is_quantized_in_slices_as_ort_does_it(params, tmp_path, monkeypatch):
    """A float16 model: the slices keep the table's dtype, and the scales come out float16, as ORT writes them."""
    monkeypatch.setattr(_tied_head_nbits, "SLICE_BYTES", 7 * K * 2)
    params = WeightOnlyParams(**params)
    expected = _by_ort_on_a_float_copy(_half(tied_model()), params)
    quantized, _ = quantize_weights(_half(tied_model()), params, LOG, tmp_path)
    _same(quantized, expected)
    assert next(t for t in quantized.graph.initializer if t.name == "table/transposed_scales").data_type == TensorProto.FLOAT16


def test_a_table_whose_file_lies_outside_the_folder_is_refused(tmp_path):
    path = artifact_of(tied_model(), tmp_path / "source").path
    model = graph_with_small_tensors(path, small_bytes=0)
    (_, _, table), = tied_heads(model)
    next(e for e in table.external_data if e.key == "location").value = "../elsewhere.data"
    with pytest.raises(ValueError, match="outside its model's folder"):
        list(_tied_head_nbits._row_slices(table, path.parent))


@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[1], {"bits": 4, "block_size": 32, "exclude": ["lm_head"]},
                                    {"bits": 4, "block_size": 32, "algorithm": "hqq", "symmetric": False}])
def test_the_worker_writes_the_model_the_pass_writes_in_process(params, tmp_path, monkeypatch):
    """The pass at WORKER_MIN_BYTES = 0 (every weight read from disk in a worker, those left in float copied from file
    to file) and in process: the same graph and weights, the same facts; the outputs run. HQQ (the float copy of the head) and an excluded head go through it too."""
    recipe = _recipe()
    feeds = {"x": np.random.default_rng(1).normal(size=(4, K)).astype(np.float32)}
    source = artifact_of(tied_model(), tmp_path / "source")
    cls = get_pass("weight_only")
    in_process = run_checked(cls(cls.Params(**params)), source, context(recipe, tmp_path / "in-process", feeds))
    monkeypatch.setattr(_weight_only_on_disk, "WORKER_MIN_BYTES", 0)
    monkeypatch.setattr(_weight_only_on_disk, "SHAPE_TENSOR_BYTES", 0)  # the worker leaves every weight on disk
    before = {p.name: p.read_bytes() for p in source.folder.iterdir()}
    worker = run_checked(cls(cls.Params(**params)), source, context(recipe, tmp_path / "worker", feeds))
    assert worker.info["weights"] == "on disk (worker)" and "weights" not in in_process.info
    assert {p.name: p.read_bytes() for p in source.folder.iterdir()} == before  # read only, nothing left beside it
    assert sorted(p.name for p in worker.folder.iterdir()) == ["info.json", "model.onnx", "model.onnx.data"]
    _same(onnx.load(str(worker.path)), onnx.load(str(in_process.path)))  # the worker appends the float ones last
    assert (worker.folder / "model.onnx.data").stat().st_size == (in_process.folder / "model.onnx.data").stat().st_size
    for key in ("candidates", "gemms_as_matmuls", "transposed_weights", "left_in_float", "quantized"):
        assert worker.info[key] == in_process.info[key]
    assert worker.info["transposed_weights"] == ([] if params.get("exclude") else ["lm_head"])
    logits = run_model(worker.path, feeds)[0]
    expected = run_model(source.path, feeds)[0]
    assert np.isfinite(logits).all() and np.corrcoef(logits.ravel(), expected.ravel())[0, 1] > 0.98


def test_a_failure_in_the_worker_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    """A truncated weights file: the worker's error comes back as the pass's one line, not a traceback."""
    recipe = _recipe()
    source = artifact_of(tied_model(), tmp_path / "source")
    data = source.folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    monkeypatch.setattr(_weight_only_on_disk, "WORKER_MIN_BYTES", 0)
    cls = get_pass("weight_only")
    with pytest.raises(Exception, match="MatMulNBits quantizer failed: .*block_size") as failure:
        cls(cls.Params(bits=4)).run(source, context(recipe, tmp_path / "worker", {}))
    assert "\n" not in str(failure.value)


def test_a_tied_head_that_cannot_be_read_is_one_line_naming_exclude(tmp_path):
    """The table's external data points outside the model's folder: the head's quantization refuses it, and the
    pass's line says how to keep the head in float."""
    path = artifact_of(tied_model(), tmp_path / "source").path
    model = onnx.load(str(path))
    table = graph_with_small_tensors(path, small_bytes=0).graph.initializer[0]
    assert table.name == "table"
    next(e for e in table.external_data if e.key == "location").value = "../elsewhere.data"
    model.graph.initializer[0].CopyFrom(table)
    with pytest.raises(PassError, match=r"tied LM head failed: .*outside.*`exclude: \['lm_head'\]`"):
        quantize_weights(model, WeightOnlyParams(bits=4), LOG, path.parent)


def test_the_passs_own_refusal_from_the_worker_is_its_line_alone(tmp_path, monkeypatch):
    """A refusal the pass itself words (here: no MatMul weight to quantize) reaches the user as that line, not
    wrapped in the worker's exception name."""
    recipe = _recipe()
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", K])])
    source = artifact_of(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "s")
    monkeypatch.setattr(_weight_only_on_disk, "WORKER_MIN_BYTES", 0)
    cls = get_pass("weight_only")
    with pytest.raises(PassError) as refused:
        cls(cls.Params(bits=4)).run(source, context(recipe, tmp_path / "worker", {}))
    assert str(refused.value).startswith("no MatMul or Gemm with a constant 2-D weight to quantize"), str(refused.value)


def test_an_onnx_sources_memory_estimate_knows_how_each_pass_runs_on_it(tmp_path, monkeypatch):
    """The memory preflight of an ONNX source takes each stage's step as a PyTorch source's does (was: the pass's
    plain factor): weight_only from 256 MB is its worker, HQQ adds the tied table's copy (its dims read from the
    graph), NNCF's data-aware compression its statistics model; and a machine too small for that is refused
    before anything runs, naming the data-aware stage."""
    from optpipe.core.errors import UserInputError
    from optpipe.plan import source_preflight
    from optpipe.safety import memory_estimate
    from optpipe.safety.recipe_loading import parse_recipe

    path = artifact_of(tied_model(), tmp_path / "source").path
    weights = path.stat().st_size + (path.parent / "model.onnx.data").stat().st_size  # the model file and its weights'
    recipe = parse_recipe({
        "model": {"onnx": str(path)}, "inputs": [{"name": "x", "shape": ["batch", K]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 4}}, "data": {"calibration": {"source": "synthetic", "samples": 2}},
        "stages": {"data": {"pass": "openvino_weights", "params": {"mode": "int4_asym", "data_aware": True}},
                   "int4": {"pass": "weight_only"}, "hqq": {"pass": "weight_only", "params": {"algorithm": "hqq", "symmetric": False}}}})
    steps = {"int4": "weight_only", "hqq": memory_estimate.WEIGHT_ONLY_COPY, "data": memory_estimate.OV_DATA_AWARE}
    expected = memory_estimate.stage_estimates(weights, steps, tied_table=4 * VOCAB * K)
    assert source_preflight.memory_estimates(recipe, path) == expected  # no eager row: an ONNX source has none
    monkeypatch.setattr(_weight_only_on_disk, "WORKER_MIN_BYTES", 0)
    worker = memory_estimate.stage_estimates(weights, {**steps, "int4": memory_estimate.WEIGHT_ONLY_WORKER}, tied_table=4 * VOCAB * K)
    assert source_preflight.memory_estimates(recipe, path) == worker and worker["int4"] < expected["int4"]
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: int((worker["data"] - 1) / memory_estimate.HEADROOM))
    too_big = source_preflight.source_preflight(recipe, path)  # the other first stages fit: they run
    assert "int4" not in too_big and too_big["data"].startswith("(openvino_weights, data-aware")
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: 1 << 20)
    with pytest.raises(UserInputError, match="^stage 'data' \\(openvino_weights, data-aware"):
        source_preflight.source_preflight(recipe, path)  # none fits: refused at once, naming the first
