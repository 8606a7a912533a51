"""recipes/yolov5s.yaml and its network (optpipe/models/yolov5.py): valid, the real YOLOv5s size, outputs that
depend on the image, and a reduced variant (yolov5n, small images) through export (issue 12 point 6)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from optpipe.models.yolov5 import YOLOv5, calibration_photos, yolov5
from optpipe.safety.recipe_loading import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]


def test_the_recipe_is_valid_and_uses_the_detection_metric():
    from optpipe.plan.validate import validate_recipe

    recipe = load_recipe(REPO / "recipes" / "yolov5s.yaml")
    validate_recipe(recipe)
    assert recipe.evaluate.task.kind == "detection" and recipe.dims["size"].multiple_of == 32
    assert recipe.stages["int8"].after == "simplify", "CNN order: int8 does not follow fuse"


def test_yolov5s_has_the_published_size():
    model = YOLOv5("s")
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 7.2  # ultralytics: 7.2 M parameters


@pytest.fixture(scope="module")
def nano():
    return yolov5("n", calibration_size=96)


def test_outputs_depend_on_the_image(nano):
    """Batch-norm statistics from photos: the confident classes and boxes change from photo to photo."""
    photos = calibration_photos(128, 4)
    with torch.no_grad():
        out = nano(photos).numpy()
    assert out.shape == (4, 3 * (16 * 16 + 8 * 8 + 4 * 4), 85)
    classes = out[..., 5:].argmax(-1)
    assert (classes[0] != classes[1]).mean() > 0.3, "class choices differ between two photos"
    boxes = out[..., :4]
    assert np.abs(boxes[0] - boxes[1]).mean() > 1.0, "boxes move by pixels, not by rounding"


def test_a_reduced_variant_exports_with_sizes_that_are_multiples_of_32(tmp_path):
    from optpipe.evaluation.self_check import onnx_outputs
    from optpipe.source.model_source import load_torch_model
    from optpipe.pass_infra.pass_base import PassContext
    from optpipe.passes.export import ExportParams, ExportPass

    recipe = parse_recipe({
        "model": {"factory": "optpipe.models.yolov5:yolov5", "kwargs": {"size": "n", "calibration_size": 64}},
        "inputs": [{"name": "images", "shape": [1, 3, "size", "size"], "range": [0, 1]}],
        "dims": {"size": {"min": 32, "opt": 64, "max": 128, "multiple_of": 32}},
        "stages": {"export": {"pass": "export", "params": {"check_atol": 0.5, "check_rtol": 1e-3}}},
    })
    workdir = tmp_path / "export"
    workdir.mkdir()
    ctx = PassContext(model_source=recipe.model_source(), evaluate=recipe.evaluate, stage="export", workdir=workdir, log=logging.getLogger("t"), cache_dir=tmp_path,
                      torch_model=lambda: load_torch_model(recipe.model_source()), eval_set=None, calibration_set=None, tolerance=None)
    artifact = ExportPass(ExportParams(check_atol=0.5, check_rtol=1e-3)).run(None, ctx)
    assert artifact.info["exporter"] == "dynamo"
    out = onnx_outputs(artifact.path, {"images": calibration_photos(96, 1).numpy()})["detections"]
    assert out.shape == (1, 3 * (12 * 12 + 6 * 6 + 3 * 3), 85), "the grid follows the input size"
