"""Shared by the serving tests: the Triton install (or why it is missing), a compiled tiny run, clients."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from optpipe.serving.triton_server import find_triton, missing_reason

INSTALL = find_triton()


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
