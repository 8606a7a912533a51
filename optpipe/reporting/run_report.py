"""The run report: data (report.json, versioned) and a Markdown view of it (report.md).

The Pareto frontier is taken over (latency at the first batch size, accuracy
error = 1 - worst mean cosine, size on disk) among ONNX stages that finished
within tolerance: a model that breaks the tolerance is flagged, never offered.
"""
from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, Field

from optpipe.artifact import write_text_atomic
from optpipe.results import StageResult
from optpipe.recipe import Recipe
from optpipe.targets import render_targets_markdown

SCHEMA_VERSION = 1
EAGER = "pytorch-eager"


class RunReport(BaseModel):
    schema_version: int = SCHEMA_VERSION
    optpipe_version: str
    recipe: str
    created: str
    machine: dict[str, Any]
    evaluation: dict[str, Any]
    reference: Optional[str]
    baseline: Optional[str] = None
    stages: list[StageResult]
    pareto: list[str] = Field(default_factory=list)
    targets: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def build(cls, recipe: Recipe, stages: list[StageResult]) -> "RunReport":
        reference = recipe.evaluate.reference or next((s.name for s in stages if s.parent is None and s.name != EAGER), None)
        report = cls(
            optpipe_version=_version(),
            recipe=recipe.name,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            machine=machine_description(),
            evaluation=recipe.evaluate.model_dump(mode="json"),
            reference=reference,
            baseline=EAGER if any(s.name == EAGER for s in stages) else None,
            stages=stages,
        )
        report.pareto = pareto_frontier(stages)
        for stage in stages:
            stage.pareto = stage.name in report.pareto
        return report

    def stage(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.name == name), None)

    @property
    def failed(self) -> list[StageResult]:
        return [s for s in self.stages if s.status != "ok"]

    @classmethod
    def load(cls, run_dir: Path) -> "RunReport":
        return cls.model_validate_json((run_dir / "report.json").read_text())


def pareto_frontier(stages: list[StageResult]) -> list[str]:
    points = {}
    for s in stages:
        if s.status != "ok" or s.name == EAGER or not s.latency or s.size_bytes is None:
            continue
        if s.accuracy is not None and not s.accuracy.within_tolerance:
            continue
        error = s.accuracy.error if s.accuracy else 0.0
        points[s.name] = (s.latency[0].p50_ms, error, float(s.size_bytes))
    return [name for name, p in points.items() if not any(_dominates(q, p) for other, q in points.items() if other != name)]


# Differences smaller than these are measurement noise, not a trade-off: a p50 within 5% of
# another's, an error within 1e-6 (float rounding of an identical model).
LATENCY_NOISE = 0.05
ERROR_NOISE = 1e-6


def _dominates(a: tuple, b: tuple) -> bool:
    """a is at least as good as b on every axis (up to noise) and clearly better on one."""
    (lat_a, err_a, size_a), (lat_b, err_b, size_b) = a, b
    no_worse = lat_a <= lat_b * (1 + LATENCY_NOISE) and err_a <= err_b + ERROR_NOISE and size_a <= size_b
    better = lat_a < lat_b * (1 - LATENCY_NOISE) or err_a < err_b - ERROR_NOISE or size_a < size_b
    return no_worse and better


def machine_description() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "libraries": {n: _dist_version(n) for n in ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy")},
    }


def write_report(report: RunReport, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "report.json", report.model_dump_json(indent=2))
    write_text_atomic(run_dir / "report.md", render_markdown(report))
    from optpipe.reporting.html import render_html  # matplotlib loads only when a report is written

    write_text_atomic(run_dir / "report.html", render_html(report))


def render_markdown(report: RunReport) -> str:
    lines = [f"# optpipe report: {report.recipe}", ""]
    lines += [f"{report.created} on {report.machine.get('processor')} ({report.machine.get('cores')} cores), "
              f"{report.evaluation.get('threads')} threads; accuracy against `{report.reference}`.", ""]
    lines += [stage_table(report), ""]
    if report.pareto:
        lines += ["Pareto frontier (latency, accuracy error, size; within tolerance): " + ", ".join(f"**{n}**" for n in report.pareto), ""]
    warned = [s for s in report.stages if s.warnings]
    if warned:
        lines += ["## Warnings", ""] + [f"- `{s.name}`: {w}" for s in warned for w in s.warnings] + [""]
    problems = [s for s in report.stages if s.status != "ok" or (s.accuracy and not s.accuracy.within_tolerance)]
    if problems:
        lines += ["## Problems", ""]
        for s in problems:
            if s.status != "ok":
                lines.append(f"- `{s.name}` {s.status}: {s.reason}")
            else:
                lines.append(f"- `{s.name}` is out of tolerance: {'; '.join(s.accuracy.violations)}")
        lines.append("")
    lines += render_targets_markdown(report.targets)
    return "\n".join(lines)


def stage_table(report: RunReport) -> str:
    batch = report.evaluation.get("batch_sizes", [1])[0]
    eager = report.stage(EAGER)
    eager_p50 = eager.latency[0].p50_ms if eager and eager.latency else None
    header = ("| stage | pass | after | status | p50 ms | p90 ms | vs eager | vs parent | cosine | max abs | size MB | Δ size "
              "| precision (MACs) | frontier |")
    rows = [header, "|" + "---|" * 14]
    for s in report.stages:
        parent = report.stage(s.parent) if s.parent else None
        lat = s.latency[0] if s.latency else None
        p_lat = parent.latency[0] if parent and parent.latency else None
        rows.append(
            "| " + " | ".join([
                s.name,
                s.pass_name,
                s.parent or "",
                s.status + (" (cached)" if s.cached and s.status == "ok" else ""),
                _f(lat.p50_ms if lat else None, ".2f"),
                _f(lat.p90_ms if lat else None, ".2f"),
                _vs_eager(lat, eager.latency[0] if eager and eager.latency else None),
                _ratio(p_lat.p50_ms if p_lat else None, lat.p50_ms if lat else None) + _busy_mark(lat, p_lat),
                _cosine(s),
                _f(max((o.max_abs for o in s.accuracy.outputs), default=None) if s.accuracy else None, ".2e"),
                _f(s.size_bytes / 1e6 if s.size_bytes else None, ".1f"),
                _size_delta(parent.size_bytes if parent else None, s.size_bytes),
                precision_cell(s),
                "★" if s.pareto else "",
            ]) + " |"
        )
    return (f"Latency at batch {batch}; 'vs' columns are speed-ups (>1x is faster); 'vs eager' against PyTorch eager "
            "timed interleaved with that stage; ⚠busy: the machine was busy while it was timed, don't trust the ratio.\n\n"
            + "\n".join(rows) + timing_notes(report))


def _vs_eager(lat, eager_lat) -> str:
    """Against the eager figure timed beside this stage; else (cached older results) the eager row's own."""
    if lat is None:
        return ""
    if lat.eager_p50_ms:
        return _ratio(lat.eager_p50_ms, lat.p50_ms) + _busy_mark(lat)
    return _ratio(eager_lat.p50_ms if eager_lat else None, lat.p50_ms) + _busy_mark(lat, eager_lat)


def _busy_mark(*latencies) -> str:
    return " ⚠busy" if any(lat is not None and lat.unreliable for lat in latencies) else ""


def timing_notes(report: RunReport) -> str:
    """How far PyTorch eager moved between stages, and which figures were timed on a busy machine."""
    lines = []
    beside = [s.latency[0].eager_p50_ms for s in report.stages if s.latency and s.latency[0].eager_p50_ms]
    if beside:
        lo, hi = min(beside), max(beside)
        lines.append(f"PyTorch eager, re-timed beside each of {len(beside)} stages: p50 {lo:.2f} to {hi:.2f} ms "
                     f"(spread {(hi - lo) / lo:.0%}).")
    for s in report.stages:
        busy = [lat for lat in s.latency if lat.unreliable]
        if busy:
            loads = {lat.load_average for lat in busy if lat.load_average is not None}
            load = f", load average {max(loads):.1f}" if loads else ""
            lines.append(f"⚠ `{s.name}`: {len(busy)} of {len(s.latency)} latency figures unreliable ({busy[0].unreliable}{load}).")
    return "\n\n" + "\n".join(f"- {line}" for line in lines) if lines else ""


def _cosine(s: StageResult) -> str:
    if not s.accuracy:
        return ""
    text = f"{s.accuracy.worst_cosine:.5f}" + guard_figure(s.accuracy)
    return text if s.accuracy.within_tolerance else text + " ⚠"


def precision_cell(s: StageResult) -> str:
    """The MAC mix (int8 / fp16 / fp32), flagged when the stage carries a warning."""
    if not s.coverage:
        return ""
    return s.coverage.summary() + (" ⚠" if s.warnings else "")


def guard_figure(accuracy) -> str:
    """The pass's guard figure beside the report's, where the two disagree (the stricter is the verdict)."""
    guard = accuracy.guard
    if guard is None or (guard.within_tolerance and abs(guard.cosine - accuracy.worst_cosine) < 1e-3):
        return ""
    return f" (guard {guard.cosine:.5f}, {guard.numerics})"


def _ratio(base: float | None, value: float | None) -> str:
    return f"{base / value:.2f}x" if base and value else ""


def _size_delta(before: int | None, after: int | None) -> str:
    return f"{(after - before) / before * 100:+.0f}%" if before and after else ""


def _f(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _version() -> str:
    return _dist_version("optpipe") or "dev"


__all__ = ["RunReport", "pareto_frontier", "precision_cell", "render_markdown", "write_report"]
