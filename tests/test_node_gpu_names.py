"""Where a figure was measured (StageResult.measured_on) names its GPUs through the same reader
as a target's gpu_type check (optpipe.core.runtime.cuda_device_names): one answer per node."""
from __future__ import annotations

import os
import stat


def test_measured_on_and_gpu_type_read_the_same_names(tmp_path, monkeypatch):
    import ctypes

    from optpipe.execution import stage_tasks
    from optpipe.core.runtime import cuda_device_names
    from optpipe.targets import gpu_type

    real_cdll = ctypes.CDLL

    def no_libcuda(name, *args, **kwargs):
        if name == "libcuda.so.1":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return real_cdll(name, *args, **kwargs)

    # No CUDA provider in this ONNX Runtime, and no libcuda: a node whose GPUs only nvidia-smi lists
    # (the old reader asked ONNX Runtime first, and said "no GPU" here while gpu_type saw two).
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=name ] && printf 'NVIDIA L4\\nNVIDIA L4\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(ctypes, "CDLL", no_libcuda)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert stage_tasks.node_description()["gpu"] == cuda_device_names() == ["NVIDIA L4", "NVIDIA L4"]
    assert gpu_type.check_gpu_type("L4", builds_engine=True)["matches"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU-only Ray task: its node shows no GPU
    assert stage_tasks.node_description()["gpu"] == [] == cuda_device_names()
