"""The run report: built from the stage results, written as report.json (the data, schema in
optpipe/core/results.py), report.md (this module's view) and report.html (reporting/html.py).

The Pareto frontier is taken over two axes, latency at the first batch size and accuracy
error (1 - worst mean cosine, or the task metric's), among ONNX stages that finished within
tolerance: a model that breaks the tolerance is flagged, never offered. Size is shown, not an
axis: with it as a third, a MobileNet int8 stage 16x slower and less accurate than `fuse`
was starred for being smaller. The report states the axes (`frontier_axes`).
"""
from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from optpipe.core.artifact import write_text_atomic
from optpipe.evaluation.speed_verdict import DECODE_BY_BITS, decode_speed_by_bits, slower_than_parent
from optpipe.recipe.run_paths import mark_run_folder
from optpipe.recipe.schema import EvaluateSpec
from optpipe.evaluation.verdict import flag_unfaithful_reference, left_in_float
from optpipe.reporting.rows import Cell, grouped_warnings, headers, stage_rows, table_note
from optpipe.core.results import EAGER, SCHEMA_VERSION, RunReport, StageResult, TargetResult
from optpipe.hardware.cpu_features import cpu_record

def build_report(name: str, evaluate: EvaluateSpec, stages: list[StageResult], data_warnings: list[str] | None = None) -> RunReport:
    """The report of one compile (the recipe's `name`, its evaluation settings): its stages, their
    Pareto frontier, the machine and settings, and what the preflight said of the data."""
    reference = evaluate.reference or next((s.name for s in stages if s.parent is None and s.name != EAGER), None)
    report = RunReport(
        optpipe_version=_version(),
        recipe=name,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=machine_description(),
        evaluation=evaluate.model_dump(mode="json"),
        reference=reference,
        baseline=EAGER if any(s.name == EAGER for s in stages) else None,
        stages=stages,
        data_warnings=data_warnings or [],
    )
    flag_unfaithful_reference(stages, reference)
    slower_than_parent(stages)
    report.pareto = pareto_frontier(stages)
    for stage in stages:
        stage.pareto = stage.name in report.pareto
    return report


def pareto_frontier(stages: list[StageResult]) -> list[str]:
    points = {}
    for s in stages:
        if s.status != "ok" or s.name == EAGER or s.headline is None or s.size_bytes is None:
            continue
        if s.accuracy is not None and not s.accuracy.within_tolerance:
            continue
        error = s.accuracy.error if s.accuracy else 0.0
        points[s.name] = (s.headline.p50_ms, error)
    return [name for name, p in points.items() if not any(_dominates(q, p) for other, q in points.items() if other != name)]


# Differences smaller than these are measurement noise, not a trade-off: a p50 within 5% of
# another's, an error within 1e-6 (float rounding of an identical model).
LATENCY_NOISE = 0.05
ERROR_NOISE = 1e-6


def _dominates(a: tuple, b: tuple) -> bool:
    """a is at least as good as b on both axes (up to noise) and clearly better on one."""
    (lat_a, err_a), (lat_b, err_b) = a, b
    no_worse = lat_a <= lat_b * (1 + LATENCY_NOISE) and err_a <= err_b + ERROR_NOISE
    better = lat_a < lat_b * (1 - LATENCY_NOISE) or err_a < err_b - ERROR_NOISE
    return no_worse and better


def machine_description() -> dict[str, Any]:
    from optpipe.hardware.container_limits import read_limits

    described = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "cpu": cpu_record(),  # the CPU class that chose the int8 formats and ran every figure
        "libraries": {n: _dist_version(n) for n in ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy")},
    }
    container = read_limits().record()  # the figures ran within these, not the host's cores and memory
    if container:
        described["container"] = container
    return described


def _container_note(machine: dict) -> str:
    limits = machine.get("container") or {}
    said = ([f"CPU quota {limits['cpu_quota']:g}"] if "cpu_quota" in limits else []) + \
        ([f"memory limit {limits['memory_limit_bytes'] / 1e9:.1f} GB"] if "memory_limit_bytes" in limits else [])
    return f"; in a container: {', '.join(said)}" if said else ""


#: report.html's plots with the digest of the data they show: a rerun with the same figures reuses them.
PLOTS_FILE = ".report-plots.json"


def write_report(report: RunReport, run_dir: Path) -> None:
    mark_run_folder(run_dir)
    write_text_atomic(run_dir / "report.json", report.model_dump_json(indent=2))
    write_text_atomic(run_dir / "report.md", render_markdown(report))
    from optpipe.reporting.html import render_html  # matplotlib loads only when a report is written

    write_text_atomic(run_dir / "report.html", render_html(report, run_dir / PLOTS_FILE))


def render_markdown(report: RunReport) -> str:
    lines = [f"# optpipe report: {report.recipe}", ""]
    cpu_class = (report.machine.get("cpu") or {}).get("class")
    cores = f"{report.machine.get('cores')} cores" + (f", {cpu_class}" if cpu_class else "") + _container_note(report.machine)
    lines += [f"{report.created} on {report.machine.get('processor')} ({cores}), "
              f"{report.evaluation.get('threads')} threads; accuracy against `{report.reference}`.", ""]
    lines += [stage_table(report), ""]
    if report.pareto:
        lines += [f"Pareto frontier ({' vs '.join(report.frontier_axes)}; stages within tolerance only): "
                  + ", ".join(f"**{n}**" for n in report.pareto), ""]
    from optpipe.reporting.html import sweep_note  # which stages report.html draws curves for, and why not the rest

    if sweep_note(report):
        lines += [sweep_note(report), ""]
    by_bits = decode_speed_by_bits(report.stages, cpu_class)
    if by_bits:
        lines += [f"## {DECODE_BY_BITS}", ""] + [f"- {line}" for line in by_bits] + [""]
    warned = grouped_warnings(report.stages)
    if warned or report.data_warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report.data_warnings]
        lines += [f"- {', '.join(f'`{n}`' for n in names)}: {w}" for w, names in warned.items()] + [""]
    exporters = export_fallbacks(report.stages)
    if exporters:
        lines += ["## Exporter fallback", ""] + [f"- {line}" for line in exporters] + [""]
    floats = left_in_float(report.stages)
    if floats:
        lines += ["## Left in float by the quantization stages", ""] + [f"- {line}" for line in floats] + [""]
    problems = [s for s in report.stages if s.status != "ok" or (s.accuracy and not s.accuracy.within_tolerance)]
    if problems:
        lines += ["## Problems", ""]
        for s in problems:
            if s.status != "ok":
                lines.append(f"- `{s.name}` {s.status}: {s.reason}")
            else:
                lines.append(f"- `{s.name}` is out of tolerance: {'; '.join(s.accuracy.violations)}")
        lines.append("")
    lines += targets_markdown(report.targets)
    from optpipe.reporting.search_views import render_search_markdown  # the search's own section, when there was one

    lines += render_search_markdown(report.search, report.hardware)
    from optpipe.reporting.serving_view import render_serving_markdown  # `optpipe serve --bench`, when it ran

    lines += render_serving_markdown(report.serving)
    return "\n".join(lines)


def export_fallbacks(stages: list[StageResult]) -> list[str]:
    """Export stages that `exporter: auto` finished with its second choice, and why the first failed."""
    lines = []
    for s in stages:
        fallback = s.info.get("fallback") if s.pass_name == "export" else None
        if fallback:
            why = "; ".join(f"{name}: {reason}" for name, reason in fallback.get("reasons", {}).items())
            lines.append(f"`{s.name}` was exported with {s.info.get('exporter')} after {why}")
    return lines


def stage_table(report: RunReport) -> str:
    """The stage table in Markdown: the same StageRows report.html renders."""
    head = headers(report)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in stage_rows(report):
        lines.append("| " + " | ".join(_markdown_cell(cell) for cell in row.cells) + " |")
    return table_note(report) + "\n\n" + "\n".join(lines)


def _markdown_cell(cell: Cell) -> str:
    text = cell.text.replace("|", "\\|")
    return text + " ⚠" if cell.tone == "out" else text


def targets_markdown(targets: list[TargetResult]) -> list[str]:
    """The report's 'Targets' section."""
    if not targets:
        return []
    lines = ["## Targets", "", "| target | stage | status | precision | provider | p50 ms | artifact |", "|---|---|---|---|---|---|---|"]
    for t in targets:
        p50 = f"{t.headline.p50_ms:.2f}" if t.headline else ""
        built = t.built_on or {}
        where = f" on {built.get('host')} [{built['ray_node']}]" if built.get("ray_node") else ""  # a Ray task's node
        status = t.describe() + (f" ⚠ {t.gpu_check['warning'].split(':')[0]}" if t.gpu_check and t.gpu_check["warning"] else "")
        lines.append(f"| {t.kind} | {t.stage} | {status} | {t.precision or ''} | {t.provider or ''}{where} | {p50} | {t.path or ''} |")
    return lines + [""]


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


__all__ = ["EAGER", "SCHEMA_VERSION", "RunReport", "build_report", "pareto_frontier", "render_markdown", "stage_table", "write_report"]
