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
