"""Inputs real models need (issue 12 point 4): grayscale / N-channel images, dims that are a
multiple of a stride, and YAML's unquoted `off`."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import yaml

from optpipe.core.errors import DataError, RecipeError
from optpipe.safety.recipe_loading import parse_recipe

TESTS = Path(__file__).resolve().parent
PHOTOS = "package:skimage/data"


def _recipe(inputs, dims=None, data=None, stages=None, model=None, **extra):
    return parse_recipe({
        "model": model or {"factory": "family_models:gray_cnn", "path": str(TESTS)},
        "inputs": inputs, "dims": dims or {"batch": {"min": 1, "opt": 2, "max": 8}},
        "data": data or {}, "stages": stages or {"export": {"pass": "export"}}, **extra,
    })


def _images(channels: int, arrange="NCHW", **preprocess):
    from optpipe.calibration.sources import load_samples

    shape = ["batch", channels, 24, 24] if arrange == "NCHW" else ["batch", 24, 24, channels]
    recipe = _recipe([{"name": "image", "shape": shape}],
                     data={"eval": {"source": "images", "path": PHOTOS, "samples": 4,
                                    "preprocess": {"files": ["camera.png", "astronaut.png"], "resize": 32, **preprocess}}})
    return load_samples(recipe.data.eval, recipe.model_source())["image"]


def test_grayscale_images_feed_a_one_channel_input():
    gray = _images(1)
    assert gray.shape == (4, 1, 24, 24) and gray.dtype == np.float32
    assert abs(gray[1].mean() - gray[0].mean()) > 0.05, "two different photos give different samples"
    assert -3 < gray.min() and gray.max() < 3, "normalised with one mean/std (ImageNet's average)"


def test_rgba_and_nhwc_layouts():
    assert _images(4).shape == (4, 4, 24, 24)
    assert _images(1, arrange="NHWC").shape == (4, 24, 24, 1)


def test_a_channel_count_images_cannot_give_is_one_sentence():
    with pytest.raises(DataError, match="takes 2 channels, which images give only as 1 .gray., 3 .rgb/bgr. or 4 .rgba."):
        _images(2, layout="NCHW")


def test_mean_with_the_wrong_channel_count_is_one_sentence():
    with pytest.raises(DataError, match="preprocess.mean has 3 values; input 'image' has 1 channels"):
        _images(1, mean=[0.4, 0.4, 0.4])


def test_a_grayscale_cnn_compiles_on_grayscale_photos(tmp_path):
    from optpipe.execution.pipeline import RunOptions, compile_recipe

    recipe = _recipe(
        [{"name": "image", "shape": ["batch", 1, 32, 32]}],
        data={"eval": {"source": "images", "path": PHOTOS, "samples": 4, "preprocess": {"resize": 40}}},
        stages={"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}},
        evaluate={"batch_sizes": [1], "warmup": 1, "iterations": 2, "eager_baseline": False},
        output=str(tmp_path / "run"),
    )
    report = compile_recipe(recipe, RunOptions(cache_dir=tmp_path / "cache"))
    assert [s.status for s in report.stages] == ["ok", "ok"], [s.reason for s in report.stages]
    assert report.stage("simplify").accuracy.worst_cosine > 0.9999


# --- dims that are a multiple of N ---------------------------------------------------------------

IMAGE_HW = [{"name": "x", "shape": [1, 3, "size", "size"]}]


def test_a_dim_bound_off_the_multiple_names_the_nearest_multiples():
    with pytest.raises(RecipeError, match=r"dims.size: opt 336 is not a multiple of 32 \(multiple_of\); use 320 or 352"):
        _recipe(IMAGE_HW, dims={"size": {"min": 32, "opt": 336, "max": 640, "multiple_of": 32}})


def test_sweeps_respect_the_multiple():
    dims = {"size": {"min": 32, "opt": 64, "max": 96, "multiple_of": 32}}
    assert _recipe(IMAGE_HW, dims=dims, evaluate={"sweep": {"size": "pow2"}}).sweep_values("size") == [32, 64, 96]
    with pytest.raises(RecipeError, match=r"evaluate.sweep.size: \[48\] not a multiple of 32"):
        _recipe(IMAGE_HW, dims=dims, evaluate={"sweep": {"size": [32, 48]}})


def test_data_off_the_multiple_is_a_readable_data_error():
    from optpipe.calibration.sources import check_samples

    recipe = _recipe(IMAGE_HW, dims={"size": {"min": 32, "opt": 64, "max": 640, "multiple_of": 32}})
    with pytest.raises(DataError, match=r"size 336 on axis 2, not a multiple of 32 \(dims.size.multiple_of\); resize the data to 320 or 352"):
        check_samples({"x": np.zeros((1, 3, 336, 336), np.float32)}, recipe.model_source(), "data source 'npy'")


def test_dynamo_export_knows_the_multiple_and_keeps_the_dim_name(tmp_path):
    from optpipe.evaluation.self_check import onnx_outputs
    from optpipe.source.model_source import load_torch_model
    from optpipe.pass_infra.pass_base import PassContext
    from optpipe.passes.export import ExportParams, ExportPass

    recipe = _recipe(IMAGE_HW, dims={"size": {"min": 32, "opt": 64, "max": 128, "multiple_of": 32}},
                     model={"factory": "family_models:strided_concat", "path": str(TESTS)})
    workdir = tmp_path / "export"
    workdir.mkdir()
    ctx = PassContext(model_source=recipe.model_source(), evaluate=recipe.evaluate, stage="export", workdir=workdir, log=logging.getLogger("t"), cache_dir=tmp_path,
                      torch_model=lambda: load_torch_model(recipe.model_source()), eval_set=None, calibration_set=None, tolerance=None)
    artifact = ExportPass(ExportParams(exporter="dynamo")).run(None, ctx)
    graph_input = artifact.load(with_weights=False).graph.input[0]
    assert [d.dim_param or d.dim_value for d in graph_input.type.tensor_type.shape.dim] == [1, 3, "size", "size"]
    out = onnx_outputs(artifact.path, {"x": np.ones((1, 3, 96, 96), np.float32)})
    assert list(out.values())[0].shape == (1, 7, 96, 96)


# --- YAML's unquoted off ---------------------------------------------------------------------------


def test_unquoted_off_reaches_a_string_mode_as_off():
    from optpipe.passes.fuse import FuseParams
    from optpipe.plan.validate import validate_recipe

    stages = yaml.safe_load("fuse: {pass: fuse, params: {transformer: off, generic: off}}")
    assert stages["fuse"]["params"]["transformer"] is False  # what YAML 1.1 makes of it
    params = FuseParams.model_validate(stages["fuse"]["params"])
    assert params.transformer == "off" and params.generic is False
    recipe = _recipe([{"name": "image", "shape": ["batch", 1, 32, 32]}],
                     stages={"export": {"pass": "export"}, "fuse": {**stages["fuse"], "after": "export"}})
    validate_recipe(recipe)


# --- structured pruning's rounding per target ----------------------------------------------------


def test_round_to_auto_is_the_targets_vector_width(monkeypatch):
    from optpipe.hardware import simd

    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", "avx2,fma,avx512f")
    assert simd.channel_multiple([]) == 16
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", "avx2,fma")
    assert simd.channel_multiple(["ort"]) == 8 and simd.channel_multiple(["tensorrt"]) == 16
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", "arm64:asimd,asimddp")
    assert simd.channel_multiple([]) == 4


def test_a_pruned_stage_slower_than_its_parent_is_flagged():
    from optpipe.evaluation.speed_verdict import slower_than_parent
    from optpipe.core.results import Latency, StageResult

    def stage(name, p50, parent=None, **info):
        latency = Latency(batch_size=1, shape={}, p50_ms=p50, p90_ms=p50, p99_ms=p50, mean_ms=p50, throughput=1 / p50,
                          iterations=5, provider="cpu")
        return StageResult(name=name, pass_name="prune" if parent else "simplify", parent=parent, status="ok",
                           latency=[latency], info=info)

    stages = [stage("simplify", 10.0), stage("prune8", 16.6, "simplify", method="structured", round_to=8),
              stage("prune16", 8.7, "simplify", method="structured", round_to=16),
              stage("noise", 10.3, "simplify", method="structured", round_to=16)]
    slower_than_parent(stages)
    assert len(stages[1].warnings) == 1 and "slower than its parent 'simplify' (16.60 vs 10.00 ms p50)" in stages[1].warnings[0]
    assert "multiples of 8" in stages[1].warnings[0]
    assert stages[2].warnings == [] and stages[3].warnings == [], "faster, or within noise"
