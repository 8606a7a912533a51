"""The layer-wise view: where inside the graph a stage's error appears.

Every intermediate tensor that exists under the same name in a reference stage
and a candidate stage is marked as a graph output (Polygraphy's ModifyOutputs),
both models run on the same inputs in ONNX Runtime, and the tensors are compared
in the candidate's graph order. The first tensors past the tolerance are where a
pass lost accuracy; tensors a pass renamed, fused away or changed the shape of
cannot be matched and are counted as skipped. A tensor whose producing op differs
between the graphs may hold a different value under the same name (ORT's quantizer
folds a Relu into the next QuantizeLinear and gives its name to the Add before it),
so such tensors are listed apart from the ones that locate where the error starts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optpipe.evaluation.cosine import real_tokens, row_cosines
from optpipe.core.errors import RunFolderError, first_line
from optpipe.recipe.schema import Tolerance
from optpipe.core.runtime import Feeds, Outputs

#: Nodes whose outputs are not activations worth comparing.
CONSTANT_OPS = {"Constant", "ConstantOfShape", "Shape", "Size"}


@dataclass
class TensorError:
    name: str
    op: str
    reference_op: str
    position: int  # index of the producing node in the candidate's graph order
    shape: list[int]
    cosine: float
    max_abs: float
    mean_abs: float
    within_tolerance: bool


@dataclass
class LayerComparison:
    reference: str
    candidate: str
    samples: int
    tolerance: dict[str, Any]
    compared: int
    skipped: dict[str, int]
    tensors: list[TensorError] = field(default_factory=list)

    @property
    def exceeding(self) -> list[TensorError]:
        """Tensors past the tolerance whose producing op is the same in both graphs, in graph order."""
        return [t for t in self.tensors if not t.within_tolerance and t.op == t.reference_op]

    @property
    def exceeding_other_producer(self) -> list[TensorError]:
        """Tensors past the tolerance produced by a different op in each graph: perhaps not the same value."""
        return [t for t in self.tensors if not t.within_tolerance and t.op != t.reference_op]

    def first_exceeding(self, count: int = 5) -> list[TensorError]:
        return self.exceeding[:count]

    def worst(self, count: int = 5) -> list[TensorError]:
        return sorted(self.tensors, key=lambda t: t.cosine)[:count]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["first_exceeding"] = [asdict(t) for t in self.first_exceeding()]
        data["exceeding_other_producer"] = [asdict(t) for t in self.exceeding_other_producer]
        return data

    def render(self, count: int = 5) -> str:
        tol = ", ".join(f"{k} {v}" for k, v in self.tolerance.items() if v is not None)
        skipped = ", ".join(f"{n} {why}" for why, n in self.skipped.items() if n)
        lines = [f"layer-wise: {self.compared} intermediate tensors of {self.candidate} compared with {self.reference} "
                 f"on {self.samples} samples (tolerance: {tol}); skipped {skipped or 'none'}"]
        first = self.first_exceeding(count)
        if not first:
            lines.append("  no intermediate tensor made by the same op in both graphs leaves the tolerance")
        else:
            lines.append(f"  {len(self.exceeding)} tensors past the tolerance; the first in graph order (where the error starts):")
            lines += _tensor_table(first)
        other = self.exceeding_other_producer
        if other:
            lines.append(f"  {len(other)} more past the tolerance are made by a different op in each graph (the name may now hold another value):")
            lines += _tensor_table(other[:count])
        worst = [t for t in self.worst(count) if t.max_abs > 0]
        if worst:
            lines.append("  largest errors:")
            lines += _tensor_table(worst)
        return "\n".join(lines)


def compare_layers(
    reference_path: Path,
    candidate_path: Path,
    feeds: Feeds,
    tolerance: Tolerance,
    threads: int = 2,
) -> LayerComparison:
    import onnx

    reference = onnx.load(str(reference_path))
    candidate = onnx.load(str(candidate_path))
    ref_tensors = _activation_order(reference)
    order = _activation_order(candidate)
    shared = [name for name in order if name in ref_tensors]
    skipped = {"not in both graphs": len(order) - len(shared)}
    ref_out = _run_with_outputs(reference, shared, feeds, threads, str(reference_path))
    cand_out = _run_with_outputs(candidate, shared, feeds, threads, str(candidate_path))
    tensors = []
    skipped.update({"not floating point": 0, "shape differs": 0})
    for name in shared:
        c, r = cand_out.get(name), ref_out.get(name)
        if c is None or r is None or not (_is_float(c) and _is_float(r)):
            skipped["not floating point"] += 1
            continue
        if c.shape != r.shape:
            skipped["shape differs"] += 1
            continue
        op, position = order[name]
        tensors.append(_tensor_error(name, op, ref_tensors[name][0], position, c, r, real_tokens(feeds), tolerance))
    return LayerComparison(
        reference=reference_path.parent.name,
        candidate=candidate_path.parent.name,
        samples=len(next(iter(feeds.values()))),
        tolerance={"cosine_min": tolerance.cosine_min, "max_abs": tolerance.max_abs},
        compared=len(tensors),
        skipped=skipped,
        tensors=tensors,
    )


def _activation_order(model) -> dict[str, tuple[str, int]]:
    """Tensor name -> (producing op, node index), for every node output that is an activation."""
    graph_outputs = {o.name for o in model.graph.output}
    found: dict[str, tuple[str, int]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type in CONSTANT_OPS:
            continue
        for name in node.output:
            if name and name not in graph_outputs:
                found[name] = (node.op_type, index)
    return found


def _run_with_outputs(model, names: list[str], feeds: Feeds, threads: int, label: str) -> Outputs:
    """Run `model` with `names` marked as outputs (Polygraphy does the marking), through ORT."""
    from polygraphy.backend.onnx import ModifyOutputs

    from optpipe.evaluation.accuracy import quiet_polygraphy
    from optpipe.core.runtime import session_options

    import onnxruntime as ort

    quiet_polygraphy()
    marked = ModifyOutputs(model, outputs=names)()
    try:
        # Graph optimizations off: ORT would otherwise fuse some marked tensors away in one model and not the other.
        session = ort.InferenceSession(marked.SerializeToString(), sess_options=session_options(threads, "disable"),
                                       providers=["CPUExecutionProvider"])
        wanted = [o.name for o in session.get_outputs()]
        inputs = {i.name for i in session.get_inputs()}
        values = session.run(wanted, {k: v for k, v in feeds.items() if k in inputs})
    except Exception as exc:  # ORT raises its own types; the stage itself ran, so name the model and the cause
        raise RunFolderError(f"cannot run '{label}' with its intermediate tensors marked as outputs: {first_line(exc)}") from None
    return dict(zip(wanted, values))


def _tensor_error(name: str, op: str, reference_op: str, position: int, cand: np.ndarray, ref: np.ndarray, mask, tol: Tolerance) -> TensorError:
    cand64 = cand.astype(np.float64)
    ref64 = ref.astype(np.float64)
    finite = bool(np.isfinite(cand64).all())
    diff = np.abs(np.nan_to_num(cand64, nan=np.inf) - ref64)
    cosine = float(row_cosines(cand64, ref64, mask).mean()) if finite and cand.size else (1.0 if not cand.size else 0.0)
    max_abs = float(diff.max()) if diff.size else 0.0
    within = finite and (tol.cosine_min is None or cosine >= tol.cosine_min) and (tol.max_abs is None or max_abs <= tol.max_abs)
    return TensorError(name, op, reference_op, position, list(cand.shape), cosine, max_abs, float(diff.mean()) if diff.size else 0.0, within)


def _is_float(array: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(array).dtype, np.floating)


def _tensor_table(tensors: list[TensorError]) -> list[str]:
    return [f"    #{t.position:<5} {_ops(t):<26} {_short(t.name):<44} cosine {t.cosine:.5f}  max abs {t.max_abs:.3g}" for t in tensors]


def _ops(t: TensorError) -> str:
    return t.op if t.op == t.reference_op else f"{t.reference_op}->{t.op}"


def _short(name: str, limit: int = 44) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1):]
