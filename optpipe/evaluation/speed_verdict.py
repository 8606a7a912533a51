"""A stage whose only purpose is speed, measured slower than its parent, says so.

Structured pruning that leaves channel counts off the kernels' vector width can make a model
slower (issue 12: YOLOv5s 1.66x slower with round_to 8 on AVX-512); an "ok" with a smaller model
would hide it. Differences within the report's latency noise are not flagged.
"""
from __future__ import annotations

from optpipe.core.results import StageResult

LATENCY_NOISE = 0.05  # the Pareto frontier's noise band (reporting.run_report)


def slower_than_parent(stages: list[StageResult]) -> None:
    """Append a warning to every structured-prune stage slower than its parent beyond noise."""
    by_name = {s.name: s for s in stages}
    for stage in stages:
        parent = by_name.get(stage.parent or "")
        if stage.status != "ok" or parent is None or not _is_structured_prune(stage):
            continue
        mine, theirs = stage.headline, parent.headline
        if mine is None or theirs is None or mine.p50_ms <= theirs.p50_ms * (1 + LATENCY_NOISE):
            continue
        round_to = stage.info.get("round_to")
        stage.warnings.append(
            f"{SLOWER_THAN_PARENT} '{parent.name}' ({mine.p50_ms:.2f} vs {theirs.p50_ms:.2f} ms p50) although smaller: "
            f"the kept channel counts (multiples of {round_to}) misfit the kernels; try another `round_to` (e.g. 16 or 32)"
        )


SLOWER_THAN_PARENT = "slower than its parent"  # how the warning starts: the report's rows tell it from others


def _is_structured_prune(stage: StageResult) -> bool:
    return stage.pass_name == "prune" and stage.info.get("method") == "structured"
