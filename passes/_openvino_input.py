"""The ONNX model an OpenVINO pass converts: the input artifact, or where OpenVINO's ONNX frontend refuses a
form the graph computes another way, a rewritten copy of its graph beside the workdir (the weights linked,
not copied). What was rewritten goes into the stage's info. Shared by the openvino and openvino_weights passes.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import onnx

from optpipe.core.artifact import MODEL_FILE, ModelArtifact
from optpipe.core.errors import PassError
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.graph.global_pools import whole_input_pools_as_global
from optpipe.pass_infra.pass_base import PassContext
from optpipe.safety.onnx_guard import external_files


@contextlib.contextmanager
def openvino_model(model: ModelArtifact, ctx: PassContext, mmap: bool = True) -> Iterator[tuple[object, dict]]:
    """(the ov.Model read from the pass's input, info on what was rewritten for OpenVINO); the rewritten copy,
    if any, lives until the block ends (unmapped, OpenVINO reads weights from the file when used)."""
    try:
        graph = onnx.load(str(model.path), load_external_data=False)
    except Exception:  # noqa: BLE001 - a file onnx cannot parse: OpenVINO's own read says why, below
        graph = None
    pools = whole_input_pools_as_global(graph) if graph is not None else []
    if not pools:
        del graph  # the block may run long (NNCF): the graph's protobuf is not kept beside it
        yield _read(model.path, mmap), {}
        return
    folder = ctx.workdir.parent / f".{ctx.workdir.name}.openvino-input"  # beside the workdir: never published
    try:
        folder.mkdir(parents=True, exist_ok=True)
        onnx.save(graph, str(folder / MODEL_FILE))
        for location, weights in external_files(graph, model.folder).items():
            _link(weights, folder / location)
        del graph
        ctx.log.info("for OpenVINO: %s rewritten as global pooling (the window covers the input)", ", ".join(pools))
        yield _read(folder / MODEL_FILE, mmap), {"rewritten_for_openvino": {"global_pooling": pools}}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: Path, mmap: bool):
    try:
        return ovr.read_onnx(path, mmap=mmap)
    except Exception as exc:  # the converter raises assorted errors on ops it cannot translate
        raise PassError(f"OpenVINO cannot convert this ONNX model: {ovr.conversion_failure(exc)}") from None


def _link(source: Path, target: Path) -> None:
    """The weights file under a second name: a hard link where the file system allows one, else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
