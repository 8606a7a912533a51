"""compare() on finite outputs skips nan_to_num's copies (the identity there) with the same figures;
non-finite candidates are still caught."""
from __future__ import annotations

import numpy as np

from optpipe.evaluation.accuracy import compare
from optpipe.evaluation.cosine import cosine_of_rows, rows_of
from optpipe.recipe.schema import Tolerance

RNG = np.random.default_rng(3)


def _reference_figures(cand, ref, mask):
    """The formulas as they were, nan_to_num on every value."""
    c, r = cand.astype(np.float64), ref.astype(np.float64)
    diff = np.abs(np.nan_to_num(c, nan=np.inf) - r)
    cos = cosine_of_rows(np.nan_to_num(rows_of(c, mask)), rows_of(r, mask))
    return diff.max(), diff.mean(), cos.mean(), cos.min()


def test_finite_outputs_give_bit_identical_figures():
    ref = RNG.normal(size=(6, 10, 16)).astype(np.float32)
    cand = (ref + RNG.normal(scale=0.05, size=ref.shape)).astype(np.float32)
    mask = (RNG.uniform(size=(6, 10)) > 0.3).astype(np.int64)
    acc = compare({"y": cand}, {"y": ref}, {"attention_mask": mask}, Tolerance(cosine_min=0.9), "ref")
    out = acc.outputs[0]
    assert (out.max_abs, out.mean_abs, out.cosine_mean, out.cosine_min) == _reference_figures(cand, ref, mask)
    assert acc.within_tolerance and out.finite


def test_a_nan_or_inf_in_the_candidate_is_still_a_violation():
    ref = RNG.normal(size=(4, 8)).astype(np.float32)
    for bad in (np.nan, np.inf):
        cand = ref.copy()
        cand[1, 3] = bad
        acc = compare({"y": cand}, {"y": ref}, {}, Tolerance(cosine_min=0.9), "ref")
        out = acc.outputs[0]
        assert not out.finite and out.cosine_min == 0.0 and out.max_abs > 1e300  # nan_to_num: inf -> float max
        assert not acc.within_tolerance and any("NaN or Inf" in v for v in acc.violations)
