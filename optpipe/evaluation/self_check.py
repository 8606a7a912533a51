"""Numeric checks a pass runs on its own output before handing it on."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from optpipe.errors import DataError, PassError, first_line
from optpipe.runtime import Feeds, Outputs, ort_runner, ort_session


def onnx_outputs(path: Path, feeds: Feeds, threads: int = 2) -> Outputs:
    try:
        session = ort_session(path, threads)
    except Exception as exc:  # ORT raises its own exception types for invalid graphs
        raise PassError(f"ONNX Runtime cannot load the result: {first_line(exc)}") from None
    return ort_runner(session)(feeds)


def agreement(candidate: Outputs, reference: Outputs) -> dict[str, float]:
    """Worst max-abs error and worst cosine over outputs paired by position."""
    worst_abs, worst_cos = 0.0, 1.0
    for cand, ref in zip(candidate.values(), reference.values()):
        cand = np.asarray(cand, np.float64)
        ref = np.asarray(ref, np.float64)
        if cand.shape != ref.shape:
            raise PassError(f"an output changed shape from {ref.shape} to {cand.shape}")
        if not np.isfinite(cand).all():
            return {"max_abs": float("inf"), "cosine": 0.0}
        worst_abs = max(worst_abs, float(np.abs(cand - ref).max()) if cand.size else 0.0)
        a, b = cand.ravel(), ref.ravel()
        denom = np.linalg.norm(a) * np.linalg.norm(b)
        worst_cos = min(worst_cos, float(a @ b / denom) if denom else float(np.array_equal(a, b)))
    return {"max_abs": worst_abs, "cosine": worst_cos}


def require_agreement(candidate: Outputs, reference: Outputs, atol: float, what: str, hint: str) -> dict[str, float]:
    require_finite(reference, "the model it starts from outputs", PassError)
    require_finite(candidate, "the result outputs", PassError)
    found = agreement(candidate, reference)
    if not found["max_abs"] <= atol:
        raise PassError(f"{what}: max abs error {found['max_abs']:.3g} exceeds {atol:g}; {hint}")
    return found


def require_finite(outputs: Outputs, whose: str, error: type[Exception] = DataError) -> Outputs:
    """`outputs` unchanged when every value is finite; else one sentence naming the output."""
    for name, value in outputs.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            bad = int(value.size - np.isfinite(value).sum())
            raise error(
                f"{whose} NaN or Inf in '{name}' ({bad} of {value.size} values); check that the inputs' "
                "`range`/data fit the model, or keep the ops that overflow in higher precision"
            )
    return outputs
