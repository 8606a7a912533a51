"""A target with gpu_type built outside Ray is checked against this machine's GPU (the detection faked)."""
from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from optpipe.core.runtime import cuda_device_names
from optpipe.targets import gpu_type as gpu_type_module
from optpipe.targets.gpu_type import check_gpu_type, gpu_type_matches


@pytest.mark.parametrize("gpu_type, name, matches", [
    ("h200", "NVIDIA H200", True),
    ("h100", "NVIDIA H100 80GB HBM3", True),
    ("h100", "NVIDIA H200", False),
    ("l4", "NVIDIA L4", True),
    ("l4", "NVIDIA L40S", False),  # a part matches whole words only
    ("l40s", "NVIDIA L40S", True),
    ("a100-80gb", "NVIDIA A100-SXM4-80GB", True),
    ("a100-80gb", "NVIDIA A100-SXM4-40GB", False),
    ("rtx4090", "NVIDIA GeForce RTX 4090", True),  # adjacent words run together
    ("t4", "Tesla T4", True),
    ("t4", "NVIDIA RTX A4000", False),
])
def test_gpu_type_matches_a_driver_name(gpu_type, name, matches):
    assert gpu_type_matches(gpu_type, name) is matches


def test_the_warning_says_where_it_was_built_and_for_what():
    assert check_gpu_type("h200", True, ["NVIDIA H200"]) == {"meant_for": "h200", "built_on": ["NVIDIA H200"], "matches": True,
                                                            "warning": None}
    engine = check_gpu_type("h200", True, ["NVIDIA L4", "NVIDIA L4"])
    assert not engine["matches"]
    assert engine["warning"].startswith("built on NVIDIA L4, NVIDIA L4, meant for h200: a TensorRT engine runs only on the GPU type")
    bundle = check_gpu_type("l4", False, [])
    assert bundle["warning"].startswith("built on no GPU, meant for l4: its figures are not the l4's")


@pytest.fixture
def warning_lines():
    """optpipe's warnings as the command line prints them (`main` installs this handler)."""
    from optpipe.execution.signals import _WarningLine

    logger = logging.getLogger("optpipe")
    if any(isinstance(h, _WarningLine) for h in logger.handlers):  # an earlier test's `main` installed it
        yield
        return
    handler = _WarningLine(level=logging.WARNING)
    logger.addHandler(handler)
    yield
    logger.removeHandler(handler)


def test_a_local_compile_says_the_gpu_type_differs(tiny_recipe, cli_run, tmp_path, monkeypatch, warning_lines):
    monkeypatch.setattr(gpu_type_module, "cuda_device_names", lambda: ["NVIDIA L4"])
    targets = [{"kind": "ort", "stages": ["simplify"], "gpu_type": "L4"},
               {"kind": "triton", "stages": ["simplify"], "gpu_type": "h200"},
               {"kind": "openvino", "stages": ["simplify"]}]
    path = tiny_recipe(targets=targets)
    result = cli_run("compile", str(path))
    assert result.exit_code == 0, result.output  # a warning, not a failure: the artifact is there
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: target")]
    assert warnings == ["warning: target triton for 'simplify' built on NVIDIA L4, meant for h200: its figures are not the "
                        "h200's; build it on a h200 (--executor ray with a node declaring gpu:h200)"]
    manifest = {a["target"]: a for a in json.loads((tmp_path / "run" / "manifest.json").read_text())["artifacts"]}
    assert manifest["triton"]["gpu_check"] == {"meant_for": "h200", "built_on": ["NVIDIA L4"], "matches": False,
                                               "warning": warnings[0].split("'simplify' ", 1)[1]}
    assert manifest["ort"]["gpu_check"]["matches"] is True and manifest["ort"]["gpu_check"]["warning"] is None
    assert manifest["openvino"]["gpu_check"] is None  # no gpu_type, nothing to check
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [t["gpu_check"]["matches"] for t in report["targets"] if t["kind"] != "openvino"] == [True, False]
    assert "⚠ built on NVIDIA L4, meant for h200 |" in (tmp_path / "run" / "report.md").read_text()

    # `optpipe export` builds on this machine too: checked the same way, here on a machine without a GPU.
    monkeypatch.setattr(gpu_type_module, "cuda_device_names", lambda: [])
    exported = cli_run("export", str(tmp_path / "run"), "--stage", "simplify", "--format", "ort", "--to", str(tmp_path / "out"))
    assert exported.exit_code == 0, exported.output
    assert "warning: target ort for 'simplify' built on no GPU, meant for l4" in exported.output
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["artifacts"][0]["gpu_check"]["built_on"] == []


def test_without_libcuda_the_names_come_from_nvidia_smi(tmp_path, monkeypatch):
    import ctypes

    real_cdll = ctypes.CDLL

    def no_libcuda(name, *args, **kwargs):
        if name == "libcuda.so.1":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return real_cdll(name, *args, **kwargs)

    smi = tmp_path / "nvidia-smi"  # a stand-in printing what the real one prints for --query-gpu=name
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=name ] && printf 'NVIDIA H200\\nNVIDIA H200\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(ctypes, "CDLL", no_libcuda)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_device_names() == ["NVIDIA H200", "NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden from this process, as Ray hides them from a CPU task
    assert cuda_device_names() == []
