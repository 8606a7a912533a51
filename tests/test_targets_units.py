"""Target logic on tiny hand-built graphs: graph facts, TensorRT build choices and command, Triton config."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import helper, numpy_helper

from optpipe.core.artifact import save_model
from optpipe.core.errors import RecipeError, TargetError
from optpipe.recipe.schema import TargetSpec
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.targets import target_settings, validate_targets
from optpipe.targets.base import StageView, TargetJob, TensorRTParams, TritonParams
from optpipe.targets.model_facts import io_specs, microsoft_ops, precision_of, sparse_2to4_layers
from optpipe.targets.tensorrt import ASSUMED_FEATURES, TrtFeatures, plan_build, polygraphy_command, standard_op_refusal
from optpipe.targets.triton import model_config, render_config

FP32_MLP = """
<ir_version: 8, opset_import: ["" : 18]>
mlp (float[batch, 8] x) => (float[batch, 4] y) <float[8, 4] w = {WEIGHTS}> {
    y = MatMul(x, w)
}
"""

FP16_CAST = """
<ir_version: 8, opset_import: ["" : 18]>
half (float[batch, 8] x) => (float[batch, 8] y) {
    h = Cast<to = 10>(x)
    r = Relu(h)
    y = Cast<to = 1>(r)
}
"""

QDQ = """
<ir_version: 8, opset_import: ["" : 18]>
qdq (float[batch, 8] x) => (float[batch, 8] y) {
    s = Constant<value = float {0.1}>()
    z = Constant<value = int8 {0}>()
    q = QuantizeLinear(x, s, z)
    y = DequantizeLinear(q, s, z)
}
"""

FUSED = """
<ir_version: 8, opset_import: ["" : 18, "com.microsoft" : 1]>
fused (float[batch, seq, 8] x, float[8] g, float[8] b) => (float[batch, seq, 8] y) {
    y = com.microsoft.SkipLayerNormalization(x, x, g, b)
}
"""

RECIPE = {
    "name": "unit",
    "model": {"onnx": "model.onnx"},
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}],
    "dims": {"batch": {"min": 1, "opt": 4, "max": 16}},
    "stages": {"export": {"pass": "export"}, "fuse": {"pass": "simplify", "after": "export"}},
    "evaluate": {"batch_sizes": [1, 8]},
}


def mlp(weights: np.ndarray) -> onnx.ModelProto:
    model = onnx.parser.parse_model(FP32_MLP.replace("{WEIGHTS}", "{" + ", ".join("0" for _ in range(32)) + "}"))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weights.astype(np.float32), "w"))
    return model


def stage(tmp_path: Path, name: str, model: onnx.ModelProto) -> StageView:
    save_model(model, tmp_path / name)
    return StageView(name, tmp_path / name)


def job(tmp_path: Path, view: StageView, kind: str, params, others: dict | None = None) -> TargetJob:
    recipe = parse_recipe(RECIPE, base_dir=tmp_path)
    return TargetJob(
        settings=target_settings(recipe, tmp_path / "cache"), spec=TargetSpec(kind=kind, stages=[view.name]), params=params, stage=view,
        out_dir=tmp_path / "out", root=tmp_path, cache_dir=tmp_path / "cache", providers=["CPUExecutionProvider"],
        stage_folder=lambda name: (others or {}).get(name),
    )


# --- graph facts ---------------------------------------------------------------------------


def test_precision_is_read_from_the_graph():
    assert precision_of(mlp(np.ones((8, 4)))) == "fp32"
    assert precision_of(onnx.parser.parse_model(FP16_CAST)) == "fp16"
    assert precision_of(onnx.parser.parse_model(QDQ)) == "int8"


@pytest.mark.parametrize("op, domain, bits, expected", [
    ("MatMulInteger", "", None, "int8"),  # ORT's dynamic int8: no Q/DQ node, it was labelled fp32
    ("QAttention", "com.microsoft", None, "int8"),
    ("MatMulNBits", "com.microsoft", 4, "int4"),  # weight-only
    ("MatMulNBits", "com.microsoft", 8, "int8"),
])
def test_integer_compute_without_qdq_is_named_by_its_op(op, domain, bits, expected):
    from onnx import helper

    attrs = {"bits": bits} if bits else {}
    node = helper.make_node(op, ["x", "w"], ["y"], domain=domain, **attrs)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([node], "g", [x], [y], [numpy_helper.from_array(np.zeros((4, 4), np.uint8), "w")])
    assert precision_of(helper.make_model(graph)) == expected


def test_microsoft_ops_are_found():
    assert microsoft_ops(onnx.parser.parse_model(FUSED)) == ["SkipLayerNormalization"]
    assert microsoft_ops(onnx.parser.parse_model(FP16_CAST)) == []


def test_2to4_pattern_is_checked_along_the_reduction_axis():
    dense = np.arange(1, 33, dtype=np.float32).reshape(8, 4)
    sparse = dense.copy()
    sparse[0::4] = 0  # MatMul B is [K, N]: groups of 4 along K, two zeros in each
    sparse[1::4] = 0
    wrong_axis = dense.copy()
    wrong_axis[:, :2] = 0  # zeros along N: not the pattern TensorRT's kernels use
    assert sparse_2to4_layers(mlp(sparse)) == {"eligible": 1, "sparse_2to4": 1}
    assert sparse_2to4_layers(mlp(dense)) == {"eligible": 1, "sparse_2to4": 0}
    assert sparse_2to4_layers(mlp(wrong_axis))["sparse_2to4"] == 0


def test_io_specs_keep_symbolic_dims():
    inputs, outputs = io_specs(mlp(np.ones((8, 4))))
    assert [(t.name, t.dtype, t.dims) for t in inputs] == [("x", "float32", ("batch", 8))]
    assert [(t.name, t.dims) for t in outputs] == [("y", ("batch", 4))]


# --- TensorRT choices ------------------------------------------------------------------------

TRT8 = TrtFeatures(version="8.6", strongly_typed=False, fp16_flag=True, int8_flag=True, calibrator=True)
TRT11 = TrtFeatures(version="11.0", strongly_typed=True, fp16_flag=False, int8_flag=False, calibrator=False)


def test_profile_comes_from_the_recipe_dims(tmp_path):
    plan = plan_build(job(tmp_path, stage(tmp_path, "s", mlp(np.ones((8, 4)))), "tensorrt", TensorRTParams()), TensorRTParams(), ASSUMED_FEATURES)
    assert plan.profile == {"x": ([1, 8], [4, 8], [16, 8])}
    assert (plan.precision, plan.strongly_typed, plan.fp16, plan.int8, plan.sparse_weights) == ("fp32", False, False, False, False)


def test_graph_precision_builds_strongly_typed_on_trt10_and_with_flags_before(tmp_path):
    view = stage(tmp_path, "half", onnx.parser.parse_model(FP16_CAST))
    j = job(tmp_path, view, "tensorrt", TensorRTParams())
    plan10 = plan_build(j, TensorRTParams(), ASSUMED_FEATURES)
    assert plan10.strongly_typed and not plan10.fp16
    plan8 = plan_build(j, TensorRTParams(), TRT8)
    assert not plan8.strongly_typed and plan8.fp16
    qdq = plan_build(job(tmp_path, stage(tmp_path, "q", onnx.parser.parse_model(QDQ)), "tensorrt", TensorRTParams()), TensorRTParams(), TRT8)
    assert qdq.int8 and qdq.fp16 and not qdq.calibrate  # explicit quantization: no calibrator


def test_builder_flags_are_refused_where_tensorrt_removed_them(tmp_path):
    view = stage(tmp_path, "s", mlp(np.ones((8, 4))))
    params = TensorRTParams(precision="fp16")
    with pytest.raises(TargetError, match="no FP16 builder flag; build from an fp16 stage"):
        plan_build(job(tmp_path, view, "tensorrt", params), params, TRT11)
    assert plan_build(job(tmp_path, view, "tensorrt", params), params, ASSUMED_FEATURES).fp16
    int8 = TensorRTParams(precision="int8")
    with pytest.raises(TargetError, match="add `data: {calibration"):
        plan_build(job(tmp_path, view, "tensorrt", int8), int8, ASSUMED_FEATURES)


def test_2to4_weights_turn_on_sparse_kernels(tmp_path):
    weights = np.ones((8, 4), np.float32)
    weights[0::2] = 0
    view = stage(tmp_path, "pruned", mlp(weights))
    assert plan_build(job(tmp_path, view, "tensorrt", TensorRTParams()), TensorRTParams(), ASSUMED_FEATURES).sparse_weights
    assert "--sparse-weights" in " ".join(polygraphy_command(plan_build(job(tmp_path, view, "tensorrt", TensorRTParams()), TensorRTParams(), ASSUMED_FEATURES)))


def test_fused_stage_is_refused_naming_its_standard_op_parent(tmp_path):
    parent = stage(tmp_path, "export", mlp(np.ones((8, 4))))
    fused = stage(tmp_path, "fuse", onnx.parser.parse_model(FUSED))
    reason = standard_op_refusal(job(tmp_path, fused, "tensorrt", TensorRTParams(), {"export": parent}))
    assert "com.microsoft ops (SkipLayerNormalization)" in reason and "standard-op stage 'export'" in reason
    assert standard_op_refusal(job(tmp_path, parent, "tensorrt", TensorRTParams())) is None


@pytest.mark.skipif(shutil.which("polygraphy") is None, reason="the polygraphy CLI is not on PATH")
def test_polygraphy_accepts_the_written_command(tmp_path):
    """Polygraphy parses every option of the command; it stops only where TensorRT is missing."""
    weights = np.ones((8, 4), np.float32)
    weights[0::2] = 0
    view = stage(tmp_path, "half", onnx.parser.parse_model(FP16_CAST))
    params = TensorRTParams(workspace_mb=512, builder_optimization_level=3, sparse_weights=True)
    plan = plan_build(job(tmp_path, view, "tensorrt", params), params, ASSUMED_FEATURES)
    command = " ".join(polygraphy_command(plan)).replace("model.onnx", str(view.model_path))
    command = command.replace("-o model.plan", f"-o {tmp_path / 'model.plan'}")
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={"TIMING_CACHE": str(tmp_path / "t.cache"), "PATH": _path()}, timeout=120)
    output = run.stdout + run.stderr
    assert "Unrecognized Options" not in output and "error: argument" not in output, output
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert "'tensorrt' is required" in output, output


def _path() -> str:
    import os

    return os.environ["PATH"]


# --- Triton config -------------------------------------------------------------------------


def parse_config(text: str):
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_triton_config_parses_and_matches_the_graph(tmp_path):
    view = stage(tmp_path, "s", mlp(np.ones((8, 4))))
    params = TritonParams()
    config = parse_config(render_config(model_config(job(tmp_path, view, "triton", params), params, "unit_s")))
    from tritonclient.grpc import model_config_pb2 as pb

    assert config.platform == "onnxruntime_onnx" and config.max_batch_size == 16
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("x", pb.TYPE_FP32, [8])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("y", pb.TYPE_FP32, [4])]
    assert list(config.dynamic_batching.preferred_batch_size) == [8]
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    assert config.parameters["intra_op_thread_count"].string_value == "2"


def test_triton_without_a_leading_dynamic_dim_does_not_batch(tmp_path):
    fixed = onnx.parser.parse_model(FP32_MLP.replace("batch", "2").replace("{WEIGHTS}", "{" + ", ".join("1" for _ in range(32)) + "}"))
    view = stage(tmp_path, "fixed", fixed)
    params = TritonParams()
    config = parse_config(render_config(model_config(job(tmp_path, view, "triton", params), params, "fixed")))
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [2, 8]
    assert not config.HasField("dynamic_batching")


def test_triton_refuses_a_batch_larger_than_the_profile(tmp_path):
    view = stage(tmp_path, "s", mlp(np.ones((8, 4))))
    params = TritonParams(max_batch_size=64)
    with pytest.raises(TargetError, match="exceeds the batch dim 'batch' max 16"):
        model_config(job(tmp_path, view, "triton", params), params, "s")


def test_target_params_errors_name_the_yaml_path(tmp_path):
    recipe = parse_recipe({**RECIPE, "targets": [{"kind": "ort"}, {"kind": "triton", "params": {"platfrom": "tensorrt"}}]}, base_dir=tmp_path)
    with pytest.raises(RecipeError, match=r"targets\.1\.params\.platfrom: unknown key \(did you mean 'platform'\?\)"):
        validate_targets(recipe.targets)


def test_triton_tensorrt_plan_without_tensorrt_is_skipped_not_half_written(tmp_path):
    from optpipe.targets.tensorrt import tensorrt_missing
    from optpipe.targets.triton import write_repository

    if tensorrt_missing() is None:
        pytest.skip("TensorRT and a GPU are here: the gpu tests cover tensorrt_plan models")
    view = stage(tmp_path, "s", mlp(np.ones((8, 4))))
    result = write_repository(job(tmp_path, view, "triton", TritonParams(platform="tensorrt")))
    assert result.status == "skipped" and result.reason.startswith("TensorRT is not installed here") and "build_engine.sh" in result.reason
    assert not (tmp_path / "out" / "unit_s").exists()
    assert (tmp_path / "tensorrt" / "s" / "build_engine.sh").is_file()  # beside the repository, not inside it
