"""The deploy recipe on the real all-MiniLM-L6-v2, once: ORT bundle, TensorRT command, Triton repository.

The artifacts are what is tested here, not the speed: latency is measured briefly and the
PyTorch baseline left out, to keep the suite short.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import optpipe
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe
from optpipe.core.runtime import ort_runner, ort_session
from optpipe.targets.tensorrt import tensorrt_missing

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "minilm-deploy.yaml"


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("minilm-deploy")
    recipe = load_recipe(RECIPE)
    recipe.evaluate = recipe.evaluate.model_copy(update={"eager_baseline": False, "warmup": 1, "iterations": 5, "batch_sizes": [1]})
    return run_dir, compile_recipe(recipe, RunOptions(output=run_dir))


def tokens(batch: int = 2, seq: int = 24) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(1000, 30000, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def test_minilm_bundle_round_trips(minilm_run):
    run_dir, report = minilm_run
    bundle = next(t.model_dump(mode="json") for t in report.targets if t.kind == "ort")
    assert bundle["status"] == "ok" and bundle["stage"] in report.pareto
    expected = ort_runner(ort_session(run_dir / "stages" / bundle["stage"] / "model.onnx", threads=2))(tokens())
    folder = run_dir / bundle["path"]
    np.testing.assert_array_equal(optpipe.load(folder).run(["last_hidden_state"], tokens())[0], expected["last_hidden_state"])
    settings = json.loads((folder / "session.json").read_text())
    assert settings["ort_format"]["status"] == "ok" and settings["ort_format"]["max_abs_vs_onnx"] <= 1e-4
    from_ort = optpipe.load(folder, format="ort").run(["last_hidden_state"], tokens())[0]
    np.testing.assert_allclose(from_ort, expected["last_hidden_state"], atol=1e-4)


def test_minilm_triton_config_has_dynamic_sequence_and_batch(minilm_run):
    from tritonclient.grpc import model_config_pb2 as pb

    run_dir, report = minilm_run
    entry = next(t.model_dump(mode="json") for t in report.targets if t.kind == "triton")
    config = text_format.Parse((run_dir / entry["path"] / "config.pbtxt").read_text(), pb.ModelConfig())
    assert config.max_batch_size == 32
    assert {t.name: (t.data_type, list(t.dims)) for t in config.input} == {
        name: (pb.TYPE_INT64, [-1]) for name in ("input_ids", "attention_mask", "token_type_ids")
    }
    assert {t.name: list(t.dims) for t in config.output} == {"last_hidden_state": [-1, 384], "pooler_output": [384]}


@pytest.mark.skipif(tensorrt_missing() is None, reason="TensorRT and a GPU are here: the engine is built instead")
def test_minilm_tensorrt_command_uses_the_recipe_dims(minilm_run):
    run_dir, report = minilm_run
    trt = next(t.model_dump(mode="json") for t in report.targets if t.kind == "tensorrt")
    assert trt["status"] == "skipped" and trt["reason"].startswith("TensorRT is not installed here")
    script = (run_dir / trt["path"] / "build_engine.sh").read_text()
    assert "--trt-max-shapes 'input_ids:[32,256]' 'attention_mask:[32,256]' 'token_type_ids:[32,256]'" in script
    assert "--minShapes=input_ids:1x8,attention_mask:1x8,token_type_ids:1x8" in script
