"""Checks before any stage runs, so that a broken model file or data set costs one line and
no compute: the ONNX source is a valid ONNX model (onnx.checker's full check, ONNX Runtime
can load it) whose inputs match the recipe, the data sets load with the recipe's shapes and dtypes.

Problems found here are the user's to fix (exit code 2); problems found while a stage
runs fail that stage and name it (exit code 1).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from optpipe.errors import DataError
from optpipe.recipe import Recipe

_DATA_PREFIX = re.compile(r"^(data(\.\w+)?( source '\w+')?:\s*)")


def preflight(recipe: Recipe, onnx_path: Path | None, eval_set: Callable[[], object], calibration_set: Callable[[], object]) -> None:
    """`onnx_path`: the model file of an ONNX recipe (resolved by the caller, from model_source).
    The data sets are built (or loaded) through the run's builders, so the stages reuse them."""
    if onnx_path is not None:
        from optpipe.safety import onnx_guard

        onnx_guard.check_source(onnx_path, recipe, "model.onnx")
    _check_data(eval_set, "eval")
    if recipe.data.calibration is not None:
        _check_data(calibration_set, "calibration")


def _check_data(build, which: str) -> None:
    """Build (or load from the cache) a sample set; its errors name `data.<which>`."""
    try:
        build()
    except DataError as exc:
        raise DataError(f"data.{which}: {_DATA_PREFIX.sub('', str(exc))}") from None
