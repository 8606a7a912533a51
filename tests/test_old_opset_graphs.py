"""A graph as older exporters wrote it (opset 9, Gemm nodes without names) through the quantizing passes.

ORT's static quantizer wrote per-channel DequantizeLinear (opset 13's `axis`) into the opset-9 model, which ONNX
Runtime refused ("internal error in pass 'int8'"); weight_only named both unnamed Gemms' bias Add '/bias', an
invalid graph its stage's evaluation then failed on. Now the int8 input is upgraded by onnx's version converter
first (said in the stage info), and the Gemm rewrite names nodes after their outputs."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers_recipes import compile_recipe, small_recipe


def _opset9_mlp(path):
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
               for name, shape in (("w1", (32, 16)), ("b1", (32,)), ("w2", (8, 32)), ("b2", (8,)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]  # no names, as old exporters left them
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4), path)


def test_an_opset9_graph_with_unnamed_gemms_quantizes_in_int8_and_weight_only(tmp_path, cli_run):
    _opset9_mlp(tmp_path / "old.onnx")
    stages = {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "static"}},
              "w8": {"pass": "weight_only", "after": "export", "params": {"bits": 8, "block_size": 16}}}
    result = compile_recipe(tmp_path, cli_run, small_recipe({"onnx": "old.onnx"}, stages=stages, samples=8))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["int8"]["status"] == "ok" and stages["w8"]["status"] == "ok"
    assert stages["int8"]["info"]["prepared"]["opset"] == "9 -> 13 (onnx.version_converter)"
    assert stages["int8"]["coverage"]["weights"]["int8"] > 0
