"""Whether this machine can build TensorRT engines: `tensorrt` imports and a CUDA device exists.

Tests that build engines carry `@pytest.mark.gpu` and `@requires_tensorrt_gpu`: they run on a
GPU machine (scripts/gpu_checks.sh runs them all) and are skipped, with the reason, elsewhere.
"""
from __future__ import annotations

import pytest


def tensorrt_gpu_missing() -> str | None:
    from optpipe.targets.tensorrt import tensorrt_missing

    return tensorrt_missing()


_MISSING = tensorrt_gpu_missing()
requires_tensorrt_gpu = pytest.mark.skipif(_MISSING is not None, reason=f"needs TensorRT and a CUDA device: {_MISSING}")
