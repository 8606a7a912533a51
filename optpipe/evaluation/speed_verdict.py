"""A stage whose only purpose is speed, measured slower than its parent, says so.

Structured pruning that leaves channel counts off the kernels' vector width can make a model
slower (issue 12: YOLOv5s 1.66x slower with round_to 8 on AVX-512); an "ok" with a smaller model
would hide it. Differences within the report's latency noise are not flagged.
"""
from __future__ import annotations

from optpipe.core.results import EAGER, StageResult

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


#: the report's section of decode_speed_by_bits, in report.md and report.html
DECODE_BY_BITS = ("Decode speed by weight precision (the fastest stage of each within its bounds; INT4 against INT8 as the "
                  "ratio of their speed-ups over the eager timed with each)")


def decode_speed_by_bits(stages: list[StageResult], cpu_class: str | None) -> list[str]:
    """Whether INT4 weights decode faster than INT8 weights and than eager on this CPU, per batch size of the
    generation, among decoder stages that held their bounds (or have random weights, whose bounds mean nothing):
    the fastest stage with any INT4 MatMuls against the fastest with INT8 ones and none in INT4. INT4 halves the
    bytes a decode step reads, but its unpacking (and a mixed stage's INT8 half, or its LoRA MatMuls) can cost
    more than that saves: Gemma 3 270M's in-bounds INT4 stage decoded at 0.75-0.78x its INT8 weight-only stage
    on x86-amx (docs/llm.md). Stages are compared by their vs-eager figures, each timed interleaved with
    its own eager, so that the host's drift between the two stages' timings cancels."""
    held = [s for s in stages if s.status == "ok" and s.name != EAGER and s.generation and s.coverage and _held(s)]
    int4 = [s for s in held if _share(s, "int4") > 0]
    int8 = [s for s in held if _share(s, "int4") == 0 and _share(s, "int8") > 0]
    if not int4:
        return []
    where = f"on this CPU ({cpu_class or 'class unknown'})"
    lines = []
    for batch in sorted({r.batch_size for s in int4 for r in s.generation.rows}):
        best4 = _fastest(int4, batch)
        if best4 is None:
            continue
        stage4, eager4, rate4 = best4
        share = _share(stage4, "int4")
        line = f"batch {batch}: INT4 `{stage4.name}` (int4 {share:.0%} of MACs) decodes {rate4:.0f} tok/s, {eager4:.2f}x eager"
        if eager4 <= 1 + LATENCY_NOISE:
            line += f" ⚠ INT4 is not faster than eager {where}"
        best8 = _fastest(int8, batch)
        if best8 is not None:
            line += _against_int8(best4, best8, where)
        lines.append(line)
    return lines


def _against_int8(best4: tuple[StageResult, float, float], best8: tuple[StageResult, float, float], where: str) -> str:
    """INT4 against INT8 by their speed-ups over eager; where their raw tokens/s say the opposite, eager's own speed
    moved between the two timings (a tiny Qwen2 under load: 1.35x by speed-up, 0.86x by tok/s, eager 1.57x apart),
    and the run answers nothing: said so, not a verdict either way. Where eager held still, the speed-up decides."""
    (_, eager4, rate4), (stage8, eager8, rate8) = best4, best8
    ratio, raw = eager4 / eager8, rate4 / rate8
    line = f", {ratio:.2f}x INT8 `{stage8.name}` ({rate8:.0f} tok/s, {eager8:.2f}x eager)"
    drift = max(rate4 / eager4, rate8 / eager8) / min(rate4 / eager4, rate8 / eager8)
    # Only where eager itself moved beyond the noise: two figures either side of the noise line by a hair (Gemma 3
    # 270M at batch 4: 1.053x by speed-up, 1.044x by tok/s, eager 1.01x apart) are the same answer.
    if (ratio > 1 + LATENCY_NOISE) != (raw > 1 + LATENCY_NOISE) and drift > 1 + LATENCY_NOISE:
        return line + (f" but {raw:.2f}x by tok/s ⚠ inconclusive in this run: eager's own speed moved {drift:.2f}x between "
                       "the two stages' timings (a busy machine?); measure again")
    return line + (f" ⚠ INT4 is not faster than INT8 {where}" if ratio <= 1 + LATENCY_NOISE else "")


def _share(stage: StageResult, precision: str) -> float:
    """The precision's share of the stage's MACs (its weight bytes' where no MACs were counted)."""
    return stage.coverage.share(precision, "macs" if stage.coverage.total_macs else "bytes")


def _held(stage: StageResult) -> bool:
    """Within its bounds, or of random weights, where the bounds judge nothing and speed is all a stage shows
    (bench/llm.py's billion-parameter shapes)."""
    return stage.accuracy is None or stage.accuracy.within_tolerance or stage.generation.weights == "random"


def _fastest(stages: list[StageResult], batch: int) -> tuple[StageResult, float, float] | None:
    """The stage with the highest decode speed-up over its interleaved eager at this batch size, that figure
    and its tokens/s."""
    timed = [(s, row.decode_tokens_per_s / row.eager_decode_tokens_per_s, row.decode_tokens_per_s) for s in stages
             for row in [s.generation.row(batch)] if row is not None and row.eager_decode_tokens_per_s]
    return max(timed, key=lambda pair: pair[1], default=None)
