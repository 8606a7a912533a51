"""Layer-wise error: which nodes of a converted model (int8, fp16) add the most error.

Both models run on the same inputs with the tensors around the candidate nodes
marked as outputs; a node's score is the relative error of its output minus that of
its input, i.e. the error the node itself added rather than what it inherited.
This works for any conversion that keeps the original tensor names at node
boundaries, which ORT's quantizers (QDQ and dynamic) and FP16 casting do.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from optpipe.runtime import Feeds, ort_session


@dataclass(frozen=True)
class NodeError:
    node: str
    op_type: str
    added_error: float  # relative error of the output minus that of the input
    output_error: float


def rank_nodes(
    reference: Path,
    converted: Path,
    nodes: list[onnx.NodeProto],
    batches: list[Feeds],
    workdir: Path,
    threads: int = 2,
) -> list[NodeError]:
    """`nodes` (of the reference model) ordered by the error each added in `converted`, worst first."""
    weights = {init.name for init in onnx.load(str(reference), load_external_data=False).graph.initializer}
    wanted = {name for node in nodes for name in (*_activation_inputs(node, weights), *node.output)}
    ref_values = tensor_values(reference, wanted, batches, workdir, threads)
    conv_values = tensor_values(converted, wanted, batches, workdir, threads)
    ranked = []
    for node in nodes:
        out = node.output[0]
        if out not in ref_values or out not in conv_values:
            continue  # the conversion renamed this boundary: nothing to compare
        out_err = relative_error(conv_values[out], ref_values[out])
        inputs = [name for name in _activation_inputs(node, weights) if name in ref_values and name in conv_values]
        in_err = max((relative_error(conv_values[n], ref_values[n]) for n in inputs), default=0.0)
        ranked.append(NodeError(node.name, node.op_type, out_err - in_err, out_err))
    return sorted(ranked, key=lambda e: e.added_error, reverse=True)


def relative_error(candidate: np.ndarray, reference: np.ndarray) -> float:
    ref = reference.astype(np.float64).ravel()
    diff = candidate.astype(np.float64).ravel() - ref
    norm = np.linalg.norm(ref)
    return float(np.linalg.norm(diff) / norm) if norm else float(np.linalg.norm(diff))


def tensor_values(model_path: Path, names: set[str], batches: list[Feeds], workdir: Path, threads: int) -> dict[str, np.ndarray]:
    """The values of the named tensors (those the model has) over all batches, concatenated."""
    model = onnx.load(str(model_path))
    produced = {out for node in model.graph.node for out in node.output} | {i.name for i in model.graph.input}
    existing = {o.name for o in model.graph.output}
    marked = sorted((names & produced) - existing)
    for name in marked:
        model.graph.output.append(onnx.ValueInfoProto(name=name))  # ORT infers the type
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = Path(tmp) / "marked.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, location="marked.onnx.data")
        # No graph optimizations: fusions would hide the very tensors being compared.
        session = ort_session(path, threads, optimization="disable")
        outputs = [o.name for o in session.get_outputs()]
        feeds_names = {i.name for i in session.get_inputs()}
        runs = [session.run(outputs, {k: v for k, v in feeds.items() if k in feeds_names}) for feeds in batches]
    return {
        name: np.concatenate([np.asarray(run[i]).reshape(-1) for run in runs])
        for i, name in enumerate(outputs)
        if name in names
    }


def _activation_inputs(node: onnx.NodeProto, weights: set[str]) -> list[str]:
    """A node's inputs that are not weights (weights have their own, separate error)."""
    return [name for name in node.input if name and name not in weights]
