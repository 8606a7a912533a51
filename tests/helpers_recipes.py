"""A small recipe written and compiled in one call: the shape most refusal tests share (a model, its inputs and
dims, synthetic data, an export stage, a short evaluation)."""
from __future__ import annotations

from pathlib import Path

import yaml

VECTOR_16 = [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}]
BATCH_4 = {"batch": {"min": 1, "opt": 2, "max": 4}}


def small_recipe(model: dict, inputs: list = VECTOR_16, dims: dict = BATCH_4, stages: dict | None = None,
                 samples: int = 4, batch: int | None = None) -> dict:
    first = dims.get("batch", {}).get("opt", 1)
    return {"name": "small", "model": model, "inputs": inputs, "dims": dims,
            "data": {"eval": {"source": "synthetic", "samples": samples}, "calibration": {"source": "synthetic", "samples": samples}},
            "stages": stages or {"export": {"pass": "export"}},
            "evaluate": {"batch_sizes": [batch or first], "warmup": 1, "iterations": 2}, "output": "run"}


def compile_recipe(tmp_path: Path, cli_run, recipe: dict):
    """Writes `recipe` as tmp_path/recipe.yaml and compiles it; the CLI's result (its report is tmp_path/run)."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return cli_run("compile", str(tmp_path / "recipe.yaml"))
