"""A guarded stage's verdict: the pass's own guard figure folded into the stage's accuracy, the
stricter of the two deciding (the guard itself: evaluation/guard.py)."""
from __future__ import annotations

from optpipe.core.results import Accuracy, GuardCheck


def fold_guard_verdict(accuracy: Accuracy | None, info: dict) -> Accuracy | None:
    """The stage's accuracy with its guard's figure beside it; the stricter of the two is the verdict.

    The report's figure comes from the evaluation provider (which may compute FP16 in FP32);
    the guard's from the numerics it measured. A guard that gave up out of tolerance is
    never reported as success, however good the report's own figure looks.
    """
    guard = info.get("guard") if isinstance(info, dict) else None
    if accuracy is None or not isinstance(guard, dict) or "held" not in guard or "numerics" not in guard:
        return accuracy
    check = GuardCheck(
        numerics=guard["numerics"],
        cosine=guard["cosine"],
        max_abs=guard["max_abs"],
        within_tolerance=guard["held"],
        gave_up=guard.get("gave_up"),
    )
    update: dict = {"guard": check}
    if not check.within_tolerance:
        why = f" ({check.gave_up})" if check.gave_up else ""
        violation = f"the pass's guard measured {check.numerics} out of tolerance: {_failed_criteria(guard)}{why}"
        update |= {"within_tolerance": False, "violations": [*accuracy.violations, violation]}
    return accuracy.model_copy(update=update)


def _failed_criteria(guard: dict) -> str:
    """The criteria the guard's figure broke, each with its value and limit (as `compare` words them).

    A guard report from before it recorded its violations names both figures instead: quoting
    only the cosine would blame a criterion that may well have held.
    """
    violations = guard.get("violations")
    if violations:
        return "; ".join(violations)
    max_abs = guard["max_abs"]
    max_abs = f"{max_abs:.3g}" if isinstance(max_abs, float) else max_abs
    return f"cosine {guard['cosine']:.5f}, max abs error {max_abs}"
