"""Memory that scales (issue 20): freed memory handed back between stages, and simplify's shape
inference on the graph alone (the weights' bytes never read for it)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from optpipe.core.artifact import save_model
from optpipe.core.process_memory import release_freed_memory
from optpipe.evaluation.memory import current_rss
from optpipe.execution.stage_runner import run_checked
from optpipe.pass_infra.pass_base import PassContext
from optpipe.passes.simplify import SimplifyParams, SimplifyPass
from optpipe.safety.recipe_loading import load_recipe

glibc_linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self/status").exists(),
                                 reason="malloc_trim and VmRSS are glibc/Linux facilities")


@glibc_linux
def test_freed_blocks_go_back_to_the_system():
    """64 KB blocks live on malloc's heap (below its mmap threshold): freed, glibc keeps their pages
    while a live block sits above them; release_freed_memory hands them back."""
    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MB, every page touched
    keeper = bytearray(64 * 1024)  # above them on the heap: the heap's top cannot shrink past it
    del blocks
    before = current_rss()
    assert release_freed_memory(force=True) is True
    after = current_rss()
    assert before - after > 120e6, (before, after)
    assert release_freed_memory() is False  # nothing grew since: not worth a collection
    del keeper


@glibc_linux
def test_memory_is_released_once_the_process_grew_enough():
    release_freed_memory(force=True)
    blocks = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MB > WORTH_RELEASING
    keeper = bytearray(64 * 1024)
    del blocks
    assert release_freed_memory() is True
    del keeper


def _shape_graph(folder: Path) -> Path:
    """x[batch, 512] @ W (512 x 1024 floats: 2 MiB, a weight the graph-only inference holds out), then a
    Reshape whose target is computed from Shape(x): what onnxslim folds once the shapes are known."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32) * 0.05, "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Shape", ["h"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="take_batch", axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"], name="unsq"),
        helper.make_node("Concat", ["batch1", "tail"], ["target"], name="cat", axis=0),
        helper.make_node("Reshape", ["h", "target"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["y"], name="relu"),
    ]
    small = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.array([32, 32], np.int64), "tail")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32, 32])], [weight, *small])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return save_model(model, folder).path


def _context(tmp_path: Path, model_path: Path) -> PassContext:
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"model: {{onnx: {model_path}}}\ninputs:\n  - {{name: x, dtype: float32, shape: [batch, 512]}}\n"
                           "dims: {batch: {min: 1, opt: 2, max: 4}}\nstages: {export: {pass: export}}\n")
    recipe = load_recipe(recipe_path)
    workdir = tmp_path / "simplify"
    workdir.mkdir()
    return PassContext(model_source=recipe.model_source(), evaluate=recipe.evaluate, stage="simplify", workdir=workdir,
                       log=logging.getLogger("test"), cache_dir=tmp_path, torch_model=lambda: None, eval_set=None,
                       calibration_set=None, tolerance=recipe.evaluate.tolerance)


def test_simplify_infers_shapes_on_the_graph_alone_and_simplifies_as_before(tmp_path, monkeypatch):
    import onnxslim

    from optpipe.core.artifact import ModelArtifact

    path = _shape_graph(tmp_path / "model")
    # A decoy where optpipe runs: onnx resolves a tensor's location against the working directory when
    # not given the model's folder; the held-out weight must never be read from it.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.onnx.data").write_bytes(b"\x7f" * 64)
    out = run_checked(SimplifyPass(SimplifyParams()), ModelArtifact.open(path.parent), _context(tmp_path, path))
    assert out.info["shape_inference"] == "graph-only"
    assert out.info["self_check"]["passed"] and out.info["self_check"]["max_abs"] < 1e-5
    reference = onnxslim.slim(onnx.load(str(path)))  # onnxslim's own way, on the whole model
    got = out.load(with_weights=False)
    assert sorted(n.op_type for n in got.graph.node) == sorted(n.op_type for n in reference.graph.node)
    assert out.info["nodes_after"] < out.info["nodes_before"], out.info  # the Shape arithmetic was folded


def test_simplify_falls_back_to_onnxslims_inference_when_the_graph_alone_is_not_enough(tmp_path, monkeypatch):
    from onnxruntime.tools import symbolic_shape_infer

    from optpipe.core.artifact import ModelArtifact

    path = _shape_graph(tmp_path / "model")
    calls = []

    def needs_a_weight(model, *args, **kwargs):  # on the graph alone, it fails as a read of a held-out weight would
        calls.append(len(model.graph.initializer))
        raise ValueError("cannot reshape array of size 0 into shape (512,1024)")

    monkeypatch.setattr(symbolic_shape_infer.SymbolicShapeInference, "infer_shapes", staticmethod(needs_a_weight))
    out = run_checked(SimplifyPass(SimplifyParams()), ModelArtifact.open(path.parent), _context(tmp_path, path))
    assert out.info["shape_inference"] == "onnxslim" and len(calls) == 1  # then onnxslim's own inference (its own import)
    assert out.info["self_check"]["passed"]
