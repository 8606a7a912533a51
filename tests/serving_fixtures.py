"""Shared by the serving tests: the Triton install (or why it is missing), a compiled tiny run, clients."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from optpipe.serving.triton_server import find_triton, missing_reason

INSTALL = find_triton()

MAX_BATCH = 8
QUEUE_DELAY_US = 200_000  # long enough that 8 simultaneous requests always meet in one batch, even on a loaded machine
CNN_OVERRIDES = {
    "model": {"factory": "tiny:build_cnn"},
    "inputs": [{"name": "image", "dtype": "float32", "shape": ["batch", 3, 16, 16]}],
    "dims": {"batch": {"min": 1, "opt": 2, "max": MAX_BATCH}},
    "stages": {"ov": {"pass": "openvino", "after": "simplify"}},
    "evaluate": {"threads": 2, "eager_baseline": False},
    "targets": [{"kind": "triton", "stages": ["simplify", "ov"],
                 "params": {"backend": "python", "max_queue_delay_us": QUEUE_DELAY_US}}],
}
_RUNS: dict[str, tuple] = {}


def cnn_run(tmp_path_factory):
    """One compile of a tiny CNN (export, simplify, an OpenVINO IR) with python-backend Triton models,
    shared by every serving test module of the session: (run folder, report)."""
    if "cnn" not in _RUNS:
        import json

        import yaml
        from conftest import TINY_RECIPE, _deep_update
        from optpipe.execution.pipeline import RunOptions, compile_recipe
        from optpipe.safety.recipe_loading import load_recipe

        folder = tmp_path_factory.mktemp("serve-cnn")
        data = json.loads(json.dumps(TINY_RECIPE))
        _deep_update(data, CNN_OVERRIDES)
        path = folder / "recipe.yaml"
        path.write_text(yaml.safe_dump(data))
        report = compile_recipe(load_recipe(path), RunOptions(output=folder / "run", cache_dir=folder / "cache"))
        _RUNS["cnn"] = (folder / "run", report)
    return _RUNS["cnn"]


def needs_triton():
    """Skip without a Triton venv, except in CI, where .ci/run makes one and its absence is a failure."""
    if INSTALL is None and os.environ.get("CI"):
        pytest.fail(f"CI must run the serving tests: {missing_reason()}")
    return pytest.mark.skipif(INSTALL is None, reason=missing_reason())


def grpc_inputs(feeds: dict[str, np.ndarray]):
    from optpipe.serving.loadtest import request_inputs

    return request_inputs(feeds)


def http_inputs(feeds: dict[str, np.ndarray]):
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in feeds.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stage_outputs(run_dir: Path, stage: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stage's own outputs, in its own runtime with the measured settings (2 threads)."""
    folder = run_dir / "stages" / stage
    if (folder / "model.xml").is_file():
        from optpipe.evaluation import openvino_runtime as ovr

        compiled = ovr.compile_model(folder / "model.xml", 2, ovr.read_settings(folder).get("hint", "f32"))
        results = compiled.create_infer_request().infer(feeds)
        return {port.any_name: np.array(results[port]) for port in compiled.outputs}
    from optpipe.core.runtime import ort_runner, ort_session

    return ort_runner(ort_session(folder / "model.onnx", threads=2))(feeds)
