"""Shared fixtures: a tiny recipe factory, an isolated cache, the CLI runner."""
from __future__ import annotations

import copy
import signal
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

# A shell starts background jobs (`cmd &`, nohup) with SIGINT ignored, and an ignored signal stays
# ignored in every process they start: the Ctrl-C tests (here and in the compiles they spawn) would
# then test nothing and fail. The suite tests Ctrl-C, so it takes Python's usual handler back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "recipes" / "models"
# The heaviest tests (a MiniLM compile, a big export in its worker, a two-node Ray cluster) peak at a few GB each.
GB_PER_TEST_PROCESS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    """How many test processes `-n auto` (pyproject's addopts) starts: one per core this run may use (its affinity
    and a container's CPU quota), at most 4, and no more than half the memory fits at GB_PER_TEST_PROCESS each."""
    from optpipe.safety.resource_bounds import available_cores, memory_budget

    return max(1, min(available_cores(), 4, memory_budget() // (GB_PER_TEST_PROCESS << 30)))


TINY_RECIPE = {
    "name": "tiny",
    "model": {"factory": "tiny:build_mlp", "path": str(MODELS)},
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 32]}],
    "dims": {"batch": {"min": 1, "opt": 4, "max": 16}},
    "data": {"eval": {"source": "synthetic", "samples": 16, "seed": 0}},
    "stages": {
        "export": {"pass": "export"},
        "simplify": {"pass": "simplify", "after": "export"},
    },
    "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 3, "threads": 1, "tolerance": {"cosine_min": 0.999}},
}


@pytest.fixture
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_recipe(tmp_path):
    """Write a tiny recipe (deep-updated with overrides) and return its path."""

    def write(overrides: dict | None = None, name: str = "recipe.yaml", **top) -> Path:
        data = copy.deepcopy(TINY_RECIPE)
        _deep_update(data, overrides or {})
        data.update(top)
        data.setdefault("output", str(tmp_path / "run"))
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


@pytest.fixture
def cli_run(cache_dir):
    """Run the optpipe CLI in-process with an isolated cache; returns click's Result."""
    from optpipe.cli import cli

    def run(*args: str, cache: Path | None = None):
        runner = CliRunner()
        return runner.invoke(cli, list(args), env={"OPTPIPE_CACHE": str(cache or cache_dir)}, catch_exceptions=False)

    return run


def _deep_update(base: dict, new: dict) -> None:
    for key, value in new.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
