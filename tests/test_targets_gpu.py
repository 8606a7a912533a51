"""TensorRT engines built for real: only where `tensorrt` imports and a CUDA device exists."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format

from optpipe.core.artifact import save_model
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe, parse_recipe
from tensorrt_gpu import requires_tensorrt_gpu

pytestmark = [pytest.mark.gpu, requires_tensorrt_gpu]

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

FP16_CAST = """
<ir_version: 8, opset_import: ["" : 18]>
half (float[batch, 64] x) => (float[batch, 64] y) {
    h = Cast<to = 10>(x)
    r = Relu(h)
    s = Mul(r, r)
    y = Cast<to = 1>(s)
}
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny recipe with a tensorrt target and a tensorrt_plan Triton model, its own cache."""
    recipe = load_recipe(RECIPES / "tiny-deploy.yaml")
    recipe.targets.append(recipe.targets[-1].model_copy(update={"stages": ["simplify"], "params": {"platform": "tensorrt", "model_name": "{recipe}_{stage}_trt"}}))
    run_dir, cache = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("cache")
    report = compile_recipe(recipe, RunOptions(output=run_dir, cache_dir=cache))
    return run_dir, cache, report


def _target(report, kind, stage, platform=None):
    return next(t.model_dump(mode="json") for t in report.targets if t.kind == kind and t.stage == stage
                and (platform is None or t.details.get("platform") == platform))


def test_engine_is_built_measured_and_cached(tiny_run):
    run_dir, cache, report = tiny_run
    trt = _target(report, "tensorrt", "simplify")
    assert trt["status"] == "ok", trt["reason"]
    assert (run_dir / trt["path"] / "model.plan").stat().st_size > 0
    accuracy = trt["accuracy"]
    assert accuracy["within_tolerance"], accuracy["violations"]
    assert min(o["cosine_mean"] for o in accuracy["outputs"]) > 0.999  # FP32 engine vs ORT FP32 reference
    assert [lat["batch_size"] for lat in trt["latency"]] == [1, 8]
    assert all(lat["provider"].startswith("TensorRT") and lat["p50_ms"] > 0 for lat in trt["latency"])
    assert list((cache / "tensorrt").glob("timing-*.cache")), "the timing cache lives in the optpipe cache"
    assert len(list((cache / "tensorrt" / "engines").glob("*.plan"))) == 1  # Triton reused the same engine


def test_triton_serves_the_engine(tiny_run):
    from tritonclient.grpc import model_config_pb2 as pb

    run_dir, _, report = tiny_run
    entry = _target(report, "triton", "simplify", platform="tensorrt_plan")
    assert entry["status"] == "ok", entry["reason"]
    folder = run_dir / entry["path"]
    config = text_format.Parse((folder / "config.pbtxt").read_text(), pb.ModelConfig())
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 16
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.KIND_GPU
    assert (folder / "1" / "model.plan").is_file() and not (folder / "1" / "model.onnx").exists()


def test_fp16_graph_builds_strongly_typed(tmp_path):
    save_model(onnx.parser.parse_model(FP16_CAST), tmp_path / "half")
    recipe = parse_recipe({
        "name": "half",
        "model": {"onnx": str(tmp_path / "half" / "model.onnx")},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 64], "range": [-2, 2]}],
        "dims": {"batch": {"min": 1, "opt": 4, "max": 8}},
        "stages": {"export": {"pass": "export"}},
        "evaluate": {"batch_sizes": [1, 4], "warmup": 2, "iterations": 10, "eager_baseline": False},
        "targets": [{"kind": "tensorrt", "stages": ["export"]}],
    }, base_dir=tmp_path)
    report = compile_recipe(recipe, RunOptions(output=tmp_path / "run", cache_dir=tmp_path / "cache"))
    trt = _target(report, "tensorrt", "export")
    assert trt["status"] == "ok", trt["reason"]
    assert trt["precision"] == "fp16" and trt["details"]["build"]["strongly_typed"]
    assert trt["accuracy"]["within_tolerance"], trt["accuracy"]["violations"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["artifacts"][0]["provider"].startswith("TensorRT")
