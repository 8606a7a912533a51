"""Shared by the fp16/prune/images tests: run one pass on a hand-built ONNX graph without a pipeline."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, parser

from optpipe.core.artifact import ModelArtifact, save_model
from optpipe.calibration.dataset import SampleSet
from optpipe.pass_infra.pass_base import PassContext
from optpipe.recipe.schema import Tolerance
from optpipe.safety.recipe_loading import parse_recipe


def graph_recipe(inputs: list[dict], dims: dict | None = None, tolerance: dict | None = None):
    """A recipe around an existing ONNX graph (only its inputs, dims and evaluation settings matter)."""
    return parse_recipe(
        {
            "model": {"onnx": "unused.onnx"},
            "inputs": inputs,
            "dims": dims or {},
            "stages": {"export": {"pass": "export"}},
            "evaluate": {"tolerance": tolerance or {"cosine_min": 0.99}, "threads": 1, "accuracy_batch": 8},
        }
    )


def artifact_of(model: onnx.ModelProto, folder: Path) -> ModelArtifact:
    onnx.checker.check_model(model)
    return save_model(model, folder)


def context(recipe, workdir: Path, eval_arrays: dict[str, np.ndarray], tolerance: Tolerance | None = None) -> PassContext:
    workdir.mkdir(parents=True, exist_ok=True)
    samples = SampleSet(eval_arrays, key="test-eval-set")
    return PassContext(
        model_source=recipe.model_source(),
        evaluate=recipe.evaluate,
        stage="under-test",
        workdir=workdir,
        log=logging.getLogger("optpipe.test"),
        cache_dir=workdir.parent / "cache",
        torch_model=lambda: None,
        eval_set=lambda: samples,
        calibration_set=lambda: samples,
        tolerance=tolerance or recipe.evaluate.tolerance,
    )


def run_model(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


MLP_16_32_8 = """
<ir_version: 9, opset_import: ["" : 17]>
mlp (float[N, 16] x) => (float[N, 8] y) {
  h = MatMul (x, w1)
  r = Relu (h)
  y = MatMul (r, w2)
}
"""


def small_mlp(rng: np.random.Generator) -> onnx.ModelProto:
    """x[N, 16] -> MatMul 'mm1' -> Relu 'relu' -> MatMul 'mm2' -> y[N, 8], weights drawn from `rng`
    (2 KB and 1 KB: an artifact keeps them in model.onnx.data, external data)."""
    model = parser.parse_model(MLP_16_32_8)
    for node, name in zip(model.graph.node, ["mm1", "relu", "mm2"]):
        node.name = name
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=(16, 32)).astype(np.float32), "w1"))
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=(32, 8)).astype(np.float32), "w2"))
    return model
