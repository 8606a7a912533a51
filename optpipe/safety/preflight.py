"""Checks before any stage runs, so that a broken model file or data set costs one line and
no compute: the ONNX source is an ONNX model whose inputs match the recipe, the data sets
load with the recipe's shapes and dtypes.

Problems found here are the user's to fix (exit code 2); problems found while a stage
runs fail that stage and name it (exit code 1).
"""
from __future__ import annotations

import re
from typing import Callable

from optpipe.errors import DataError
from optpipe.recipe import OnnxModel, Recipe

_DATA_PREFIX = re.compile(r"^(data(\.\w+)?( source '\w+')?:\s*)")


def preflight(recipe: Recipe, eval_set: Callable[[], object], calibration_set: Callable[[], object]) -> None:
    """Build (or load) the data sets through the run's builders, so the stages reuse them."""
    if isinstance(recipe.model, OnnxModel):
        from optpipe.safety import onnx_guard
        from optpipe.model_source import onnx_source_path

        path = onnx_source_path(recipe)
        graph = onnx_guard.load_graph(path, "model.onnx")
        onnx_guard.check_inputs_match(graph, recipe, path.name)
    _check_data(eval_set, "eval")
    if recipe.data.calibration is not None:
        _check_data(calibration_set, "calibration")


def _check_data(build, which: str) -> None:
    """Build (or load from the cache) a sample set; its errors name `data.<which>`."""
    try:
        build()
    except DataError as exc:
        raise DataError(f"data.{which}: {_DATA_PREFIX.sub('', str(exc))}") from None
