"""Tiny hand-built models and a recipe around them, for the inspect/diff/report tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, WIDTH, OUT = 16, 32, 8


def mlp_model(seed: int = 0, second_layer_noise: float = 0.0) -> onnx.ModelProto:
    """x[batch, sequence, 16] -> MatMul -> Add -> Relu -> MatMul -> Tanh -> y[batch, sequence, 8].

    It also carries what a simplifier removes: an Identity and a constant Add
    that folds (two constants added, then added to the activations).
    `second_layer_noise` perturbs only the second MatMul's weights, so a layer-wise
    comparison must find the error starting there.
    """
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((HIDDEN, WIDTH)).astype(np.float32) * 0.3
    b1 = rng.standard_normal(WIDTH).astype(np.float32) * 0.1
    w2 = rng.standard_normal((WIDTH, OUT)).astype(np.float32) * 0.3
    w2 = w2 + np.random.default_rng(99).standard_normal(w2.shape).astype(np.float32) * second_layer_noise
    half = np.full(WIDTH, 0.05, dtype=np.float32)
    nodes = [
        helper.make_node("Identity", ["x"], ["x_copy"], name="identity"),
        helper.make_node("MatMul", ["x_copy", "w1"], ["hidden"], name="fc1"),
        helper.make_node("Add", ["half_a", "half_b"], ["bias_extra"], name="fold_me"),
        helper.make_node("Add", ["hidden", "b1"], ["hidden_b"], name="fc1_bias"),
        helper.make_node("Add", ["hidden_b", "bias_extra"], ["hidden_bb"], name="extra_bias"),
        helper.make_node("Relu", ["hidden_bb"], ["act"], name="relu"),
        helper.make_node("MatMul", ["act", "w2"], ["pre"], name="fc2"),
        helper.make_node("Tanh", ["pre"], ["y"], name="squash"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", OUT])],
        initializer=[numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (half, "half_a"), (half, "half_b"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def mlp_recipe(model_path: Path, output: Path, **evaluate) -> dict:
    settings = {"batch_sizes": [1, 4], "warmup": 1, "iterations": 3, "threads": 1,
                "sweep": {"batch": "pow2", "sequence": [2, 8, 16]}, "sweep_iterations": 2}
    settings.update(evaluate)
    return {
        "name": "tiny-mlp",
        "model": {"onnx": str(model_path)},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", "sequence", HIDDEN]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 8}, "sequence": {"min": 2, "opt": 4, "max": 16}},
        "data": {"eval": {"source": "synthetic", "samples": 8}},
        "stages": {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}},
        "evaluate": settings,
        "output": str(output),
    }
