"""A compile's error lines and exit code, read from its results (README's exit-code table).

Exit 2 when every failure is the user's input (error_kind "input": a checkpoint that does not
fit, a forward() that refuses the recipe's inputs): the user has one thing to change. Any other
failed stage or target means something beyond the input broke too: exit 1.
"""
from __future__ import annotations

from typing import Sequence

from optpipe.core.results import StageResult, TargetResult

STAGE_FAILED, USER_INPUT = 1, 2


def failure_lines(failed: Sequence[StageResult], targets: Sequence[TargetResult], prefix: str = "") -> tuple[list[str], int]:
    """(lines, exit code) for the failed and skipped stages and the failed targets; (`[]`, 0) when none."""
    lines = [f"error: {prefix}target {t.kind} for '{t.stage}' failed: {t.reason}" for t in targets]
    # The eager baseline last: a broken source is named by the stage that met it first, not by the baseline.
    stages = sorted((s for s in failed if s.status == "failed"), key=lambda s: s.pass_name == "eager")
    shown, reasons = [], set()
    for stage in stages:
        if stage.error_kind == "input" and stage.reason in reasons:
            continue  # one broken source, met again (by the eager baseline): one line
        reasons.add(stage.reason)
        shown.append(stage)
    # The stages skipped after them are counted, not repeated.
    skipped = len(failed) - len(stages)
    for i, stage in enumerate(shown):
        tail = f"; {skipped} stage{'s' if skipped != 1 else ''} after it skipped" if skipped and i == len(shown) - 1 else ""
        lines.append(f"error: {prefix}stage '{stage.name}' failed: {stage.reason}{tail}")
    if not failed and not targets:
        return lines, 0
    only_input = stages and not targets and all(s.error_kind == "input" for s in stages)
    return lines, USER_INPUT if only_input else STAGE_FAILED
