"""Where the cosine cannot tell, and what holds an output there: the share of the reference's variation across
samples a candidate reproduces (R²).

The cosine is taken per row of the last axis. A regression head's output [batch, 1] has rows of one value, whose
cosine is its sign, blind to any error that keeps it: those are held by R² always. An fp16 stage of a model predicting ~1000 +- 0.2 read cosine 1.00000, ok, while its outputs
moved in steps of 0.5. An output far from zero next to its spread (pixel boxes, prices, an unnormalised target)
has rows that all point one way, so a candidate ignoring its inputs would pass as well. The test is that
candidate itself: the reference's mean over the samples, a constant output. Where it scores the cosine bound,
the bound says nothing about the output, and the output is held by R² instead:
1 - sum((candidate - reference)^2) / sum((reference - its mean over samples)^2) >= 2 * cosine_min - 1.
That is the cosine's own error budget (1 - cosine ~ |error|^2 / 2|reference|^2 for small errors) measured
against how far the output moves between samples rather than against its size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optpipe.evaluation.cosine import cosine_of_rows, rows_of

#: Elements of one sample's output above which the check is skipped: the mean over the samples is one sample's
#: size in float64 (32 MB here); a 262k-vocabulary LM's logits have long rows whose cosine can tell anyway.
SAMPLE_ELEMENTS_MAX = 1 << 22


@dataclass(frozen=True)
class Variation:
    constant_cosine: float  # the cosine the reference's mean over the samples scores
    explained: float | None  # R² of the candidate; None where the reference does not vary across samples
    single_values: bool = False  # rows of one value: their cosine is a sign, blind to any error that keeps it


def variation(cand: np.ndarray, ref: np.ndarray, mask) -> Variation | None:
    """The constant output's cosine and the candidate's R², over the rows the cosine counts (real tokens where a
    [batch, seq] mask fits); None for fewer than 2 samples, a non-float or non-finite output, or a huge sample."""
    if ref.dtype.kind != "f" or ref.ndim == 0 or len(ref) < 2 or ref.shape != cand.shape:
        return None
    # A 1-d output is one row across the samples, as the cosine reads it: one slice (data sets hold <= MAX_SAMPLES).
    per_sample = int(np.prod(ref.shape[1:], dtype=np.int64))
    if per_sample == 0 or per_sample > SAMPLE_ELEMENTS_MAX:
        return None
    mean = ref.mean(axis=0, dtype=np.float64)
    if not np.isfinite(mean).all():
        return None
    step = max(SAMPLE_ELEMENTS_MAX // per_sample, 1)
    fits = mask is not None and ref.ndim >= 3 and ref.shape[:2] == np.shape(mask)
    parts = [_sums(cand[s:s + step], ref[s:s + step], mean, mask[s:s + step] if fits else None) for s in range(0, len(ref), step)]
    if None in parts:  # a non-finite candidate: a violation of its own (NaN or Inf values)
        return None
    cosines, error, spread = (sum(p[i] for p in parts) for i in range(3))
    rows = sum(p[3] for p in parts)
    return Variation(constant_cosine=cosines / rows if rows else 1.0, explained=1.0 - error / spread if spread > 0 else None,
                     single_values=ref.shape[-1] == 1)


def _sums(cand: np.ndarray, ref: np.ndarray, mean: np.ndarray, mask) -> tuple[float, float, float, int] | None:
    """One slice of samples: the constant's cosines summed, the candidate's squared error, the reference's squared
    spread, and the rows (None where the candidate is not finite)."""
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    if not np.isfinite(c).all():
        return None
    m = np.broadcast_to(mean, r.shape)
    rows_r, rows_c, rows_m = rows_of(r, mask), rows_of(c, mask), rows_of(m, mask)
    return (float(cosine_of_rows(rows_m, rows_r).sum()), float(((rows_c - rows_r) ** 2).sum()),
            float(((rows_r - rows_m) ** 2).sum()), len(rows_r))


def explained_bound(cosine_min: float) -> float:
    """The R² an output the cosine cannot judge must reach: the same error budget as `cosine_min`."""
    return 2.0 * cosine_min - 1.0


#: The least spread across samples, relative to the output's size (accuracy.input_sensitivity), R² is measured on:
#: 1e-4 is ~840 float32 steps, so the rounding differences of two float32 runtimes (~1e-6 of the size) move R² by
#: ~1e-4. Under it no figure can tell, and the input-sensitivity warning says the figures mean nothing.
RESOLVABLE_SPREAD = 1e-4


def cosine_cannot_tell(found: Variation | None, cosine_min: float | None, sensitivity: float | None) -> bool:
    """Rows of one value, or a constant output (the reference's mean) would meet the bound; and R² can be measured."""
    return (found is not None and cosine_min is not None and found.explained is not None
            and (sensitivity is None or sensitivity >= RESOLVABLE_SPREAD)
            and (found.single_values or found.constant_cosine >= cosine_min))


def explained_violation(name: str, explained: float, constant_cosine: float, cosine_min: float) -> str:
    return (f"output '{name}' reproduces {explained:.4f} of the reference's variation across samples (R²) < "
            f"{explained_bound(cosine_min):.4f}: its cosine cannot tell (a constant output scores {constant_cosine:.5f})")
