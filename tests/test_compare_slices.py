"""compare() takes big outputs a slice of rows at a time (accuracy.SLICE_ELEMENTS): its figures and verdicts
are the ones of the whole arrays, whatever the slice, on every kind of output it meets."""
from __future__ import annotations

import numpy as np
import pytest

from optpipe.evaluation import accuracy
from optpipe.recipe.schema import Tolerance

RNG = np.random.default_rng(7)


def _outputs():
    logits = RNG.standard_normal((3, 5, 11)).astype(np.float32)
    hidden = RNG.standard_normal((3, 5, 2, 4)).astype(np.float32)  # more than one row per token
    nan_logits = logits + np.float32(0.01)
    nan_logits[1, 2, 3] = np.nan
    return [
        ("logits", logits, logits + RNG.normal(0, 0.05, logits.shape).astype(np.float32)),
        ("hidden", hidden, hidden * np.float32(1.001)),
        ("scores", RNG.standard_normal(7).astype(np.float32), RNG.standard_normal(7).astype(np.float32)),  # 1-d: one row
        ("classes", np.array([[1, 2, 3], [4, 5, 6]]), np.array([[1, 2, 0], [4, 5, 6]])),  # integers: equality
        ("logits_nan", logits, nan_logits),
        ("zeros", np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)),
    ]


def _whole(cand, ref, mask, tol: Tolerance, top1: bool) -> dict:
    """The figures over the whole arrays at once, written out as compare() computed them before it took slices."""
    from optpipe.evaluation.cosine import cosine_of_rows, rows_of

    discrete = ref.dtype.kind in "iub"
    c, r = np.asarray(cand, np.float64), np.asarray(ref, np.float64)
    finite = bool(np.isfinite(c).all())
    diff = np.abs((c if finite else np.nan_to_num(c, nan=np.inf)) - r)
    rows_c, rows_r = rows_of(c, mask), rows_of(r, mask)
    cosines = cosine_of_rows(rows_c if finite else np.nan_to_num(rows_c), rows_r)
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "finite": finite,
            "cosine_mean": float(cosines.mean()) if finite else 0.0, "cosine_min": float(cosines.min()) if finite else 0.0,
            "top1": float(np.mean(rows_c.argmax(-1) == rows_r.argmax(-1))) if top1 else None,
            "beyond_tolerance": float(np.mean(diff > tol.max_abs + tol.rtol * np.abs(r))),
            "equal_share": float(np.mean(c == r)) if discrete else None}


@pytest.mark.parametrize("slice_elements", [1, 7, 40, 1 << 22])
@pytest.mark.parametrize("masked", [False, True])
def test_sliced_figures_equal_the_whole_arrays(monkeypatch, slice_elements, masked):
    monkeypatch.setattr(accuracy, "SLICE_ELEMENTS", slice_elements)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], np.int64) if masked else None
    tolerance = Tolerance(cosine_min=0.99, max_abs=0.1, rtol=0.01)
    for name, ref, cand in _outputs():
        fits = mask is not None and ref.ndim >= 3
        expected = _whole(cand, ref, mask if fits else None, tolerance, top1="logit" in name)
        got = accuracy._output_accuracy(name, cand, ref, mask, None, tolerance).model_dump()
        for field, value in expected.items():
            if isinstance(value, float):
                assert got[field] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, field)
            else:
                assert got[field] == value, (name, field)


def test_the_masked_cosine_counts_real_tokens_only():
    ref = RNG.standard_normal((2, 3, 6))
    cand = ref.copy()
    cand[0, 2] = -ref[0, 2]  # a padded position: garbage there must not count
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    figures = accuracy._output_accuracy("last_hidden_state", cand, ref, mask, None, Tolerance())
    assert figures.cosine_min == pytest.approx(1.0)
    assert accuracy._output_accuracy("last_hidden_state", cand, ref, None, None, Tolerance()).cosine_min == pytest.approx(-1.0)


@pytest.mark.parametrize("slice_elements", [3, 1 << 22])
def test_polygraphy_s_verdict_holds_on_slices(monkeypatch, slice_elements):
    monkeypatch.setattr(accuracy, "SLICE_ELEMENTS", slice_elements)
    ref = RNG.standard_normal((4, 6, 5)).astype(np.float32)
    close, off = ref + np.float32(1e-6), ref.copy()
    off[3, 5, 4] += 1.0  # one element, in the last slice
    tolerance = Tolerance(max_abs=1e-3, rtol=1e-3)
    assert accuracy._polygraphy_match([("out", close, ref)], tolerance) is True
    assert accuracy._polygraphy_match([("out", off, ref)], tolerance) is False
    assert accuracy._polygraphy_match([("out", np.zeros((0, 5), np.float32), np.zeros((0, 5), np.float32))], tolerance) is True


def test_input_sensitivity_in_blocks_equals_the_whole(monkeypatch):
    ref = RNG.standard_normal((5, 9, 3))
    whole = accuracy.input_sensitivity(ref)
    monkeypatch.setattr(accuracy, "SLICE_ELEMENTS", 4)
    assert accuracy.input_sensitivity(ref) == pytest.approx(whole, rel=1e-12)
    masked = ref.copy()
    masked[4, 8, 2] = -np.inf  # a model that means -inf (masked logits): no magnitude, no spread there
    assert np.isfinite(accuracy.input_sensitivity(masked))
    bad = ref.copy()
    bad[4, 8, 2] = np.nan
    assert accuracy.input_sensitivity(bad) is None
    assert accuracy.input_sensitivity(ref[:1]) is None
