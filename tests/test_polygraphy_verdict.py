"""Polygraphy's compare function is part of the accuracy verdict, not just a recorded field."""
from __future__ import annotations

import numpy as np

from optpipe.evaluation import accuracy
from optpipe.recipe.schema import Tolerance


def outputs(scale: float):
    reference = {"y": np.linspace(-1, 1, 64).reshape(4, 16)}
    return {"y": reference["y"] + scale}, reference


def test_polygraphy_decides_the_elementwise_check_with_ours():
    tolerance = Tolerance(cosine_min=None, max_abs=1e-3)
    within = accuracy.compare(*outputs(5e-4), {}, tolerance, "ref")
    assert within.within_tolerance and within.polygraphy_match is True
    beyond = accuracy.compare(*outputs(5e-3), {}, tolerance, "ref")
    assert not beyond.within_tolerance and beyond.polygraphy_match is False


def test_a_polygraphy_failure_alone_is_a_violation(monkeypatch):
    # Where Polygraphy's verdict is stricter than our own figures, it stands.
    monkeypatch.setattr(accuracy, "_polygraphy_match", lambda pairs, tol: False)
    result = accuracy.compare(*outputs(5e-4), {}, Tolerance(cosine_min=None, max_abs=1e-3), "ref")
    assert not result.within_tolerance and result.violations == ["Polygraphy's elementwise comparison (atol/rtol per output) fails"]
