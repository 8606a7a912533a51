"""Accuracy of a stage against the reference: per output max/mean abs error, cosine, top-1.

Polygraphy runs the ONNX models (`Comparator.run` over an `OnnxrtRunner`) and
does the elementwise tolerance check; the cosine and top-1 statistics it does
not offer are computed here. Cosine is per row of the last axis (per token for
transformers) over real tokens only when the inputs have an attention mask.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from optpipe.results import Accuracy, OutputAccuracy
from optpipe.recipe import Tolerance
from optpipe.runtime import Feeds, Outputs

MASK_INPUT = "attention_mask"


def quiet_polygraphy() -> None:
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR


def run_onnx(path: Path, batches: list[Feeds], threads: int, providers: list[str] | None = None) -> Outputs:
    """Outputs of an ONNX model over all batches, through Polygraphy, concatenated along axis 0."""
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    from optpipe.runtime import ort_session

    quiet_polygraphy()
    runner = OnnxrtRunner(ort_session(path, threads, providers), name="candidate")
    results = Comparator.run([runner], data_loader=batches)
    iterations = results["candidate"]
    return {name: np.concatenate([np.asarray(it[name]) for it in iterations]) for name in iterations[0].keys()}


def run_callable(run: Callable[[Feeds], Outputs], batches: list[Feeds]) -> Outputs:
    outs = [run(b) for b in batches]
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def compare(
    candidate: Outputs,
    reference: Outputs,
    inputs: Feeds,
    tolerance: Tolerance,
    reference_name: str,
    top1: bool | None = None,
) -> Accuracy:
    """Compare outputs pairwise, by name when the names match, else by position."""
    pairs = _pair_outputs(candidate, reference)
    mask = inputs.get(MASK_INPUT)
    outputs = [_output_accuracy(name, c, r, mask, top1) for name, c, r in pairs]
    violations = _violations(outputs, tolerance)
    return Accuracy(
        reference=reference_name,
        samples=len(next(iter(inputs.values()))) if inputs else 0,
        outputs=outputs,
        within_tolerance=not violations,
        violations=violations,
        polygraphy_match=_polygraphy_match(pairs, tolerance),
    )


def _pair_outputs(candidate: Outputs, reference: Outputs) -> list[tuple[str, np.ndarray, np.ndarray]]:
    if set(candidate) == set(reference):
        return [(name, candidate[name], reference[name]) for name in reference]
    if len(candidate) != len(reference):
        raise ValueError(f"the model has {len(candidate)} outputs, the reference {len(reference)}")
    return [(rname, c, reference[rname]) for (rname, c) in zip(reference, candidate.values())]


def _output_accuracy(name: str, cand: np.ndarray, ref: np.ndarray, mask, top1: bool | None) -> OutputAccuracy:
    cand = np.asarray(cand, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if cand.shape != ref.shape:
        raise ValueError(f"output '{name}' has shape {cand.shape}, the reference {ref.shape}")
    finite = bool(np.isfinite(cand).all())
    diff = np.abs(np.nan_to_num(cand, nan=np.inf) - ref)
    rows_c, rows_r = _rows(cand, mask), _rows(ref, mask)
    cosines = _cosine_rows(np.nan_to_num(rows_c), rows_r)
    want_top1 = top1 if top1 is not None else "logit" in name.lower()
    agreement = float(np.mean(rows_c.argmax(-1) == rows_r.argmax(-1))) if want_top1 else None
    return OutputAccuracy(
        name=name,
        max_abs=float(diff.max()) if diff.size else 0.0,
        mean_abs=float(diff.mean()) if diff.size else 0.0,
        cosine_mean=float(cosines.mean()) if finite else 0.0,
        cosine_min=float(cosines.min()) if finite else 0.0,
        top1=agreement,
        finite=finite,
    )


def row_cosines(candidate: np.ndarray, reference: np.ndarray, mask=None) -> np.ndarray:
    """Cosine per row of the last axis (real tokens only where the mask fits), as the tolerance measures it."""
    cand = np.asarray(candidate, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    return _cosine_rows(np.nan_to_num(_rows(cand, mask)), _rows(ref, mask))


def _rows(array: np.ndarray, mask) -> np.ndarray:
    """[rows, last axis]; with a [batch, seq] mask matching the leading axes, real tokens only."""
    if array.ndim >= 3 and mask is not None and array.shape[:2] == mask.shape:
        return array[mask.astype(bool)].reshape(-1, array.shape[-1])
    if array.ndim == 1:
        return array.reshape(1, -1)
    return array.reshape(-1, array.shape[-1])


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    dots = np.sum(a * b, axis=-1)
    # Two all-zero rows are identical; one zero row against a non-zero one is not.
    both_zero = norms == 0
    return np.where(both_zero, np.where(np.abs(a - b).sum(-1) == 0, 1.0, 0.0), dots / np.where(both_zero, 1, norms))


def _violations(outputs: list[OutputAccuracy], tol: Tolerance) -> list[str]:
    found = []
    for out in outputs:
        if not out.finite:
            found.append(f"output '{out.name}' has NaN or Inf values")
            continue
        if tol.cosine_min is not None and out.cosine_mean < tol.cosine_min:
            found.append(f"output '{out.name}' cosine {out.cosine_mean:.4f} < {tol.cosine_min}")
        if tol.max_abs is not None and out.max_abs > tol.max_abs:
            found.append(f"output '{out.name}' max abs error {out.max_abs:.3g} > {tol.max_abs}")
        if tol.top1_min is not None and out.top1 is not None and out.top1 < tol.top1_min:
            found.append(f"output '{out.name}' top-1 agreement {out.top1:.3f} < {tol.top1_min}")
    return found


def _polygraphy_match(pairs, tol: Tolerance) -> bool | None:
    """Polygraphy's own elementwise check, where the recipe sets an absolute tolerance."""
    if tol.max_abs is None:
        return None
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.comparator.struct import IterationResult

    try:
        from polygraphy.comparator import SimpleCompareFunc as simple
    except ImportError:  # Polygraphy < 0.50
        from polygraphy.comparator import CompareFunc

        simple = CompareFunc.simple
    quiet_polygraphy()
    results = RunResults()
    results.append(("candidate", [IterationResult({n: c for n, c, _ in pairs}, runner_name="candidate")]))
    results.append(("reference", [IterationResult({n: r for n, _, r in pairs}, runner_name="reference")]))
    verdict = Comparator.compare_accuracy(results, compare_func=simple(atol=tol.max_abs, rtol=0.0))
    return bool(verdict)
