"""Where a lower-precision model departs from the FP32 one: per-tensor error, and the nodes that create it.

Both models get their intermediate tensors added as graph outputs and run on the
same inputs in ONNX Runtime. A node is blamed by how much error it *adds*: its
output's relative error minus the worst relative error of its inputs, so an op
that only passes on an upstream error is not blamed for it. A node that turns
finite inputs into inf/NaN (FP16 overflow) is blamed first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper

from optpipe.core.runtime import Feeds, session_options

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


@dataclass(frozen=True)
class NodeBlame:
    node: str
    op: str
    input_error: float
    output_error: float

    @property
    def overflow(self) -> bool:
        return math.isinf(self.output_error) and not math.isinf(self.input_error)

    @property
    def added_error(self) -> float:
        if math.isinf(self.input_error):
            return 0.0  # the damage was done upstream
        return self.output_error - self.input_error

    def reason(self) -> str:
        if self.overflow:
            return "output overflows to inf/NaN in FP16 while its inputs are finite"
        return f"relative error grows from {self.input_error:.2e} at its inputs to {self.output_error:.2e} at its output"

    def as_dict(self) -> dict:
        return {
            "node": self.node,
            "op": self.op,
            "input_error": _jsonable(self.input_error),
            "output_error": _jsonable(self.output_error),
            "reason": self.reason(),
        }


def relative_error(candidate: np.ndarray, reference: np.ndarray) -> float:
    """Mean abs error over the reference's mean magnitude; inf where the candidate is not finite."""
    candidate = np.asarray(candidate, np.float64)
    reference = np.asarray(reference, np.float64)
    if candidate.shape != reference.shape or not np.isfinite(candidate).all():
        return math.inf
    if not np.isfinite(reference).all():
        return 0.0  # the FP32 model itself is not finite here: nothing to blame on precision
    scale = float(np.abs(reference).mean()) if reference.size else 0.0
    diff = float(np.abs(candidate - reference).mean()) if reference.size else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def float_activations(model: onnx.ModelProto, types: dict[str, int]) -> list[str]:
    """Names of the float tensors computed by the graph's nodes (not initializers or inputs)."""
    initializers = {init.name for init in model.graph.initializer}
    names = []
    for node in model.graph.node:
        for name in node.output:
            if name and name not in initializers and types.get(name) in FLOAT_TYPES:
                names.append(name)
    return names


def run_with_outputs(model: onnx.ModelProto, names: Iterable[str], feeds: Feeds, threads: int) -> dict[str, np.ndarray]:
    """Run `model` with `names` added as float graph outputs; returns {name: value}."""
    import onnxruntime as ort

    marked = onnx.ModelProto()
    marked.CopyFrom(model)
    existing = {out.name for out in marked.graph.output}
    wanted = [name for name in dict.fromkeys(names)]
    for name in wanted:
        if name not in existing:
            marked.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(
        marked.SerializeToString(), sess_options=session_options(threads), providers=["CPUExecutionProvider"]
    )
    inputs = {i.name: i.type for i in session.get_inputs()}
    feed = {name: _as_input_type(value, inputs[name]) for name, value in feeds.items() if name in inputs}
    values = session.run(wanted, feed)
    return dict(zip(wanted, values))


def blame_nodes(
    model: onnx.ModelProto,
    reference: dict[str, np.ndarray],
    candidate: dict[str, np.ndarray],
    skip: set[str],
) -> list[NodeBlame]:
    """Nodes of `model` (the FP32 graph) ranked by the error they add; overflow first, then added error."""
    errors = {name: relative_error(candidate[name], reference[name]) for name in reference if name in candidate}
    blames = []
    for node in model.graph.node:
        if node.name in skip:
            continue
        outputs = [errors[name] for name in node.output if name in errors]
        if not outputs:
            continue
        inputs = [errors[name] for name in node.input if name in errors]
        blame = NodeBlame(node.name, node.op_type, max(inputs, default=0.0), max(outputs))
        if blame.overflow or blame.added_error > 0:
            blames.append(blame)
    return sorted(blames, key=lambda b: (not b.overflow, -b.added_error))


def _as_input_type(value: np.ndarray, ort_type: str) -> np.ndarray:
    if ort_type == "tensor(float16)" and value.dtype == np.float32:
        return value.astype(np.float16)
    return value


def _jsonable(value: float) -> float | str:
    return value if math.isfinite(value) else "inf"
