"""A full or read-only disk during the PyTorch export is the disk's fault, not the exporter's: one
line naming it (exit 2), never "set `exporter: dynamo`" (what a full /tmp printed, measured)."""
from __future__ import annotations

import errno
import os

import pytest
from reliability_fixtures import run_main

from optpipe.passes import _torch_export


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only file system")])
def test_a_disk_error_inside_the_exporter_names_the_disk_not_the_exporter(tiny_recipe, cache_dir, monkeypatch, capsys, code, words):
    def failing(*args, **kwargs):
        raise RuntimeError("export failed") from OSError(code, os.strerror(code), str(args[-1]))

    monkeypatch.setattr(_torch_export, "export_torchscript", failing)
    monkeypatch.setattr(_torch_export, "export_dynamo", failing)
    path = tiny_recipe()
    exit_code, _, err = run_main(["compile", str(path), "--cache-dir", str(cache_dir)], capsys)
    assert exit_code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0] and "exporter" not in errors[0], err
    assert "Traceback" not in err


def test_an_export_onnx_runtime_cannot_run_is_the_exporters_failure_not_an_internal_error(tiny_recipe, cache_dir,
                                                                                          monkeypatch, capsys):
    # A tiny Mamba's TorchScript export held a Tile whose repeats were 2-d: ORT refused it at the very shape it was traced
    # at, and the stage read "internal error in pass 'export' (InvalidArgument ...)".
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    def refused(*args, **kwargs):
        shape = numpy_helper.from_array(np.array([-1, 7], np.int64), "shape")  # 32 * batch values: never rows of 7
        graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["output"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
                                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)], [shape])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(args[4]))
        return []

    monkeypatch.setattr(_torch_export, "export_torchscript", refused)
    monkeypatch.setattr(_torch_export, "export_dynamo", refused)
    exit_code, _, err = run_main(["compile", str(tiny_recipe()), "--cache-dir", str(cache_dir)], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors and "internal error" not in err and "Traceback" not in err, err
    assert "ONNX Runtime cannot run the torchscript export" in errors[0] and "make those dims fixed" in errors[0], err
    assert exit_code == 1, err
