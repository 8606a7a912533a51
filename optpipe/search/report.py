"""The search's part of the report as data: every trial with its params, the frontier over the
trials, the best trial within tolerance, and each param's effect (report.json's `search`).
The Markdown/HTML views of it are optpipe.reporting.search_views."""
from __future__ import annotations

from typing import Any


def search_section(driver, report, wall_s: float) -> dict[str, Any]:
    trials = []
    for record in driver.records:
        stage = report.stage(record.stage) if record.stage else None
        trials.append(_trial_row(record, stage))
    refused = bool(report.hardware and report.hardware.get("frontier") == "refused")
    objectives = driver.settings.objectives
    frontier = [] if refused else trial_frontier(trials, objectives)
    feasible = [] if refused else trial_frontier(trials, objectives, within_tolerance_only=True)
    if report.hardware and report.hardware.get("frontier") == "per node type":
        frontier = [name for name in frontier if name in report.pareto]
    best = _best(trials, feasible, objectives)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    settings = driver.settings
    return {
        "strategy": driver.strategy,
        "sampler": settings.sampler if driver.strategy == "optuna" else None,
        "objectives": objectives,
        "space": driver.space.describe(),
        "space_size": driver.space.size,
        "budget": {"trials": driver.budget, "wall_time_s": settings.wall_time_s},
        "stopped": driver.stopped or "done",
        "wall_s": round(wall_s, 1),
        "counts": ", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
        "trials": trials,
        "frontier": frontier,
        "frontier_within_tolerance": feasible,
        "frontier_note": report.hardware.get("reason") if refused else None,
        "best": best,
        "effects": _effects(driver.space, trials),
    }


# Differences within these are noise, not a trade-off: p50 within 5% (as the report's own
# frontier), accuracy error within 1e-6, size within 1%: the same model exported in another
# process differs by tens of bytes of metadata (measured: 1745 vs 1818 bytes of model.onnx).
NOISE = {"latency": ("relative", 0.05), "accuracy": ("absolute", 1e-6), "size": ("relative", 0.01)}


def trial_frontier(trials: list[dict], objectives: list[str], within_tolerance_only: bool = False) -> list[str]:
    """The measured trials that no other beats on the search's objectives (all minimised here).

    Over all of them, the trade-off curve (out-of-tolerance points flagged where shown); within
    tolerance only, the candidates a user may pick."""
    points = {}
    for t in trials:
        measured = t["status"] in ("ok", "out of tolerance")
        if not measured or within_tolerance_only and t["status"] != "ok" or t["repeat_of"] is not None or "p50_ms" not in t:
            continue
        values = {"latency": t["p50_ms"], "accuracy": _error(t), "size": float(t.get("size_bytes") or 0)}
        points[t["stage"]] = {o: values[o] for o in objectives}
    return [name for name, p in points.items() if not any(_dominates(q, p) for other, q in points.items() if other != name)]


def _dominates(a: dict, b: dict) -> bool:
    def slack(axis: str, value: float) -> float:
        kind, amount = NOISE[axis]
        return value * amount if kind == "relative" else amount

    no_worse = all(a[o] <= b[o] + slack(o, b[o]) for o in a)
    better = any(a[o] < b[o] - slack(o, b[o]) for o in a)
    return no_worse and better


def _error(t: dict) -> float:
    """A trial's distance from the reference on the axis the run's own frontier uses (the task's
    metric where the recipe names a task: a search must not rank by cosine what the verdict
    judges by top-1 or mAP)."""
    return t["error"] if "error" in t else 1.0 - t.get("cosine", 1.0)


def _data(value: Any) -> Any:
    """A list choice (a tuple in the space, to be hashable) as the list report.json holds."""
    return list(value) if isinstance(value, tuple) else value


def _trial_row(record, stage) -> dict[str, Any]:
    off = {key.rsplit(".", 1)[0] for key, value in record.trial.values if key.endswith(".enabled") and value is False}
    row: dict[str, Any] = {
        "number": record.number,
        # The params of a stage that is off played no part: they are left out.
        "params": {k: _data(v) for k, v in record.trial.values if k.rsplit(".", 1)[0] not in off or k.endswith(".enabled")},
        "stage": record.stage,
        "repeat_of": record.repeat_of,
        "status": "failed",
        "reason": "every searched stage is off and the chain starts at the model: nothing to measure",
    }
    if record.refused:
        row["reason"] = record.refused
    if stage is None:
        return row
    row.update(status=stage.status, reason=stage.reason, cached=stage.cached, evaluation_cached=stage.evaluation_cached,
               size_bytes=stage.size_bytes,
               measured_on=stage.measured_on)
    if stage.latency:
        row["p50_ms"] = stage.latency[0].p50_ms
    if stage.accuracy:
        row["cosine"] = stage.accuracy.worst_cosine
        row["error"] = stage.accuracy.error  # the verdict's axis: 1 - the task's headline metric, else 1 - cosine
        row["within_tolerance"] = stage.accuracy.within_tolerance
        if stage.status == "ok" and not stage.accuracy.within_tolerance:
            row["status"] = "out of tolerance"
            row["reason"] = "; ".join(stage.accuracy.violations)
    return row


def _best(trials: list[dict], feasible: list[str], objectives: list[str]) -> dict | None:
    """The pick among the candidates (the frontier within tolerance): the lowest of the first
    objective that is a cost (latency: p50 at the first batch size, or size), ties to the more
    accurate; the most accurate when accuracy is the only objective. Never a point another
    candidate beats on every objective, and never ranked on an axis the search was not asked
    to weigh (a noisy p50 must not pick the winner of a search over accuracy and size)."""
    fit = [t for t in trials if t["stage"] in feasible and t["status"] == "ok" and t["repeat_of"] is None]
    if not fit:
        return None
    axis = next((o for o in objectives if o != "accuracy"), "accuracy")
    value = {"latency": lambda t: t["p50_ms"], "size": lambda t: float(t.get("size_bytes") or 0), "accuracy": _error}[axis]
    top = min(fit, key=lambda t: (value(t), _error(t)))
    rule = {"latency": "lowest p50", "size": "smallest", "accuracy": "most accurate"}[axis]
    return {"number": top["number"], "stage": top["stage"], "rule": f"{rule} on the frontier within tolerance"}


def _effects(space, trials: list[dict]) -> dict[str, list[dict]]:
    """Per searched param and value: trials, how many held the tolerance, best p50, mean cosine
    (a param of an optional stage counts only the trials where the stage is on)."""
    effects = {}
    unique = [t for t in trials if t["repeat_of"] is None]
    for dim in space.dimensions:
        rows = []
        for value in dim.values:
            group = [t for t in unique if t["params"].get(dim.key) == _data(value)]
            if not group:
                continue
            ok = [t for t in group if t["status"] == "ok"]
            cosines = [t["cosine"] for t in group if "cosine" in t]
            latencies = [t["p50_ms"] for t in ok if "p50_ms" in t]
            rows.append({
                "value": _data(value),
                "trials": len(group),
                "within_tolerance": len(ok),
                "best_p50_ms": min(latencies) if latencies else None,
                "mean_cosine": sum(cosines) / len(cosines) if cosines else None,
                "worst_cosine": min(cosines) if cosines else None,
            })
        effects[dim.key] = rows
    return effects
