"""report.html: a self-contained view of report.json for people, readable offline.

Every plot is drawn with matplotlib into an inline SVG (text kept as text), and
the style sheet is inline: the file opens anywhere, with no CDN and no script.
Shows the stage DAG, the stage table with deltas against each stage's parent,
the Pareto plot (latency vs accuracy error, point size by model size, frontier
highlighted) and one latency/throughput curve per batch size and per swept dim.
"""
from __future__ import annotations

import hashlib
import html
import json
import re
from pathlib import Path

from optpipe.evaluation.speed_verdict import DECODE_BY_BITS, decode_speed_by_bits
from optpipe.evaluation.verdict import left_in_float
from optpipe.reporting.rows import Cell, grouped_warnings, headers, out_of_tolerance, stage_rows, table_note
from optpipe.core.results import EAGER, Latency, RunReport, StageResult, TargetResult
from optpipe.reporting.plot_svg import figure as _figure, svg as _svg

OK, FAILED, OUT = "#2e7d32", "#c62828", "#ef6c00"
FRONTIER = "#f9a825"
CANDIDATE = "#5c7cbf"
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def render_html(report: RunReport, plots_file: Path | None = None) -> str:
    """The page; `plots_file`: where the plots drawn last time are kept with the data they show, so
    that a rerun with the same figures (a cached compile) does not import matplotlib to draw them again."""
    plots = _plots(report, plots_file)
    sections = [
        _header(report),
        _section("Stages", plots["dag"] + _stage_table(report)),
        _section("Pareto: latency vs accuracy error", plots["pareto"]),
    ]
    note = sweep_note(report)
    for title, svg in plots["curves"]:
        sections.append(_section(title, svg + (f"<p class='note'>{html.escape(note)}</p>" if note else "")))
    by_bits = decode_speed_by_bits(report.stages, (report.machine.get("cpu") or {}).get("class"))
    if by_bits:
        sections.append(_section(DECODE_BY_BITS, "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in by_bits) + "</ul>"))
    sections.append(_problems(report))
    sections.append(_targets(report.targets))
    floats = left_in_float(report.stages)
    if floats:
        sections.append(_section("Left in float by the quantization stages",
                                 "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in floats) + "</ul>"))
    from optpipe.reporting.search_views import render_search_html  # a search's trials, frontier and param effects

    sections.append(render_search_html(report.search, report.hardware))
    from optpipe.reporting.serving_view import render_serving_html  # `optpipe serve --bench`: req/s vs concurrency

    sections.append(render_serving_html(report.serving))
    body = "\n".join(s for s in sections if s)
    return _PAGE.format(title=html.escape(f"optpipe report: {report.recipe}"), style=_STYLE, body=body)


def _plots(report: RunReport, plots_file: Path | None) -> dict:
    """{"dag", "pareto", "curves": [(title, svg)]}: drawn, or read from `plots_file` when it holds
    the plots of the same data (the digest of everything the plots read)."""
    digest = hashlib.sha256(json.dumps(_plotted_data(report), sort_keys=True).encode()).hexdigest()
    if plots_file is not None:
        try:
            kept = json.loads(plots_file.read_text(encoding="utf-8"))
            if kept.get("digest") == digest:
                return kept["plots"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # none yet, or unreadable: drawn again
    plots = {"dag": _dag_svg(report), "pareto": _pareto_svg(report),
             "curves": [(title, _curves_svg(curves, title)) for title, curves in _latency_curves(report)]}
    if plots_file is not None:
        from optpipe.core.artifact import write_text_atomic

        try:
            write_text_atomic(plots_file, json.dumps({"digest": digest, "plots": plots}))
        except OSError:
            pass  # a read-only run folder: the page is still written, the next one draws again
    return plots


#: Bump when a plot's drawing changes: plots kept from an older version are drawn again.
PLOTS_FORMAT = 1


def _plotted_data(report: RunReport) -> dict:
    """Everything the plots read (not the creation time, stage durations or cache flags)."""
    fields = {"name", "parent", "status", "pass_name", "pareto", "latency", "accuracy", "size_bytes"}
    return {"format": PLOTS_FORMAT, "evaluation": report.evaluation,
            "stages": [s.model_dump(mode="json", include=fields) for s in report.stages]}


def sweep_note(report: RunReport) -> str | None:
    """Which stages have sweep curves, and why the others have none (None when nothing was swept)."""
    sweep = report.evaluation.get("sweep") or {}
    if not sweep:
        return None
    swept = [s.name for s in report.stages if any(lat.sweep for lat in s.latency)]
    rest = [s for s in report.stages if s.name not in swept]
    text = f"Sweep curves ({', '.join(sweep)}): " + (", ".join(swept) or "none") + "."
    if not rest:
        return text
    why = []
    for s in rest:
        if s.status != "ok":
            why.append(f"{s.name} ({s.status})")
        elif any("latency sweep failed" in w for w in s.warnings):
            why.append(f"{s.name} (its sweep failed, see its warnings)")
        elif s.name == EAGER:
            why.append(f"{s.name} (the baseline is swept only beside stages swept in the same evaluation)")
        elif report.evaluation.get("sweep_stages", "frontier") == "frontier":
            why.append(f"{s.name} (not on the Pareto frontier)")
        else:
            why.append(s.name)
    return text + " None for " + ", ".join(why) + ("; `evaluate.sweep_stages: all` sweeps every stage."
                                                     if report.evaluation.get("sweep_stages", "frontier") == "frontier" else ".")


# --- page parts ----------------------------------------------------------------------------


def _header(report: RunReport) -> str:
    m, e = report.machine, report.evaluation
    return (
        f"<h1>optpipe report: {html.escape(report.recipe)}</h1>"
        f"<p class='meta'>{html.escape(report.created)} · {html.escape(str(m.get('processor')))} ({m.get('cores')} cores) · "
        f"{e.get('threads')} threads · accuracy against <code>{html.escape(str(report.reference))}</code> · "
        f"optpipe {html.escape(report.optpipe_version)}</p>"
    )


def _section(title: str, content: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>\n{content}\n</section>"


def _stage_table(report: RunReport) -> str:
    """The same StageRows report.md renders; tones become colours."""
    rows = []
    for row in stage_rows(report):
        cells = [_html_cell(cell) for cell in row.cells]
        cells[0] = f"<b>{cells[0]}</b>"
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    note = f"<p class='note'>{html.escape(table_note(report))}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers(report))
    # The stage table has ~18 columns: headers wrap and the table scrolls inside its own box, so the
    # page keeps its width (it ran 1.6x past a 1200 px page before).
    return (note + "<div class='wide'><table class='stages'><thead><tr>" + head + "</tr></thead><tbody>" + "".join(rows)
            + "</tbody></table></div>")


def _html_cell(cell: Cell) -> str:
    text = html.escape(cell.text) + (" ⚠" if cell.tone == "out" else "")
    colour = {"ok": OK, "out": OUT, "failed": FAILED}.get(cell.tone or "")
    return f"<span style='color:{colour}'>{text}</span>" if colour else text


def _problems(report: RunReport) -> str:
    items = [f"<li>warning: {html.escape(w)}</li>" for w in report.data_warnings]
    items += [f"<li>{', '.join(f'<code>{html.escape(n)}</code>' for n in names)} warning: {html.escape(w)}</li>"
              for w, names in grouped_warnings(report.stages).items()]
    for s in report.stages:
        if s.status != "ok":
            items.append(f"<li><code>{html.escape(s.name)}</code> {s.status}: {html.escape(s.reason or '')}</li>")
        elif s.accuracy and not s.accuracy.within_tolerance:
            items.append(f"<li><code>{html.escape(s.name)}</code> is out of tolerance: {html.escape('; '.join(s.accuracy.violations))}</li>")
    return _section("Problems", "<ul>" + "".join(items) + "</ul>") if items else ""


def _targets(targets: list[TargetResult]) -> str:
    """The artifacts written, as report.md's Targets table; a `built on` column only when some target
    was built on a Ray node (`built_on` is None for one built by the driver itself: a local run)."""
    if not targets:
        return ""
    remote = any(t.built_on for t in targets)
    head = ["target", "stage", "status", "precision", "provider", "p50 ms", "artifact"] + (["built on"] if remote else [])
    rows = []
    for t in targets:
        status = t.describe()
        if t.gpu_check and t.gpu_check.get("warning"):
            status += f" ⚠ {t.gpu_check['warning']}"
        colour = {"ok": OK, "failed": FAILED}.get(t.status, OUT)
        cells = [html.escape(t.kind), f"<code>{html.escape(t.stage)}</code>", f"<span style='color:{colour}'>{html.escape(status)}</span>",
                 html.escape(t.precision or ""), html.escape(t.provider or ""),
                 f"{t.headline.p50_ms:.2f}" if t.headline else "", f"<code>{html.escape(t.path)}</code>" if t.path else ""]
        if remote:
            cells.append(html.escape(built_on_text(t.built_on)))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = ("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
             + "".join(rows) + "</tbody></table>")
    return _section("Targets", table)


def built_on_text(node: dict | None) -> str:
    """`host [Ray node] · CPU xcores · GPUs` from a target's built_on (optpipe.execution.stage_tasks.node_description)."""
    if not node:
        return ""
    where = str(node.get("host") or "?") + (f" [{node['ray_node']}]" if node.get("ray_node") else "")
    machine = f"{node['cpu']} x{node.get('cores')}" if node.get("cpu") else ""
    gpus = ", ".join(node.get("gpu") or [])
    return " · ".join(part for part in (where, machine, gpus) if part)


# --- plots ---------------------------------------------------------------------------------


def _dag_svg(report: RunReport) -> str:
    """The stage DAG left to right by depth; colour = status, gold border = on the frontier."""
    import networkx as nx

    stages = [s for s in report.stages if s.name != EAGER]
    graph = nx.DiGraph()
    for s in stages:
        graph.add_node(s.name)
        if s.parent:
            graph.add_edge(s.parent, s.name)
    if not graph:
        return ""
    for depth, layer in enumerate(nx.topological_generations(graph)):
        for name in layer:
            graph.nodes[name]["depth"] = depth
    pos = nx.multipartite_layout(graph, subset_key="depth")
    depth_count = max(d["depth"] for _, d in graph.nodes(data=True)) + 1
    width = max(4.0, 2.2 * depth_count)
    height = max(1.6, 0.9 * max(len(layer) for layer in nx.topological_generations(graph)))
    fig = _figure(width, height)
    ax = fig.add_subplot()
    by_name = {s.name: s for s in stages}
    for a, b in graph.edges:
        ax.annotate("", xy=pos[b], xytext=pos[a], arrowprops=dict(arrowstyle="-|>", color="#555", shrinkA=38, shrinkB=38))
    for name, (x, y) in pos.items():
        s = by_name[name]
        colour = OK if s.status == "ok" and not out_of_tolerance(s) else OUT if s.status == "ok" else FAILED
        lat = s.headline
        detail = f"{lat.p50_ms:.2f} ms" if lat else s.status
        if s.accuracy:
            detail += " · " + s.accuracy.figure("cos ")
        ax.text(x, y, f"{name}\n{s.pass_name}\n{detail}", ha="center", va="center", fontsize=8, color="white",
                bbox=dict(boxstyle="round,pad=0.4", fc=colour, ec=FRONTIER if s.pareto else colour, lw=3 if s.pareto else 1))
    ax.set_xlim(min(x for x, _ in pos.values()) - 0.5, max(x for x, _ in pos.values()) + 0.5)
    ax.set_ylim(min(y for _, y in pos.values()) - 0.5, max(y for _, y in pos.values()) + 0.5)
    ax.axis("off")
    return _svg(fig, "dag")


def _pareto_svg(report: RunReport) -> str:
    points = [s for s in report.stages if s.status == "ok" and s.headline is not None]
    if not points:
        return "<p>No stage has a latency measurement.</p>"
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot()
    sizes = [s.size_bytes for s in points if s.size_bytes]
    biggest = max(sizes) if sizes else 1
    for s in points:
        x, y = s.headline.p50_ms, _error(s)
        area = 40 + 600 * (s.size_bytes / biggest) if s.size_bytes else 60
        if s.name == EAGER:
            ax.scatter([x], [y], s=90, marker="D", color="#555", label="PyTorch eager", zorder=3)
        elif out_of_tolerance(s):
            ax.scatter([x], [y], s=area, marker="X", color=FAILED, alpha=0.8, zorder=3)
        else:
            ax.scatter([x], [y], s=area, color=FRONTIER if s.pareto else CANDIDATE,
                       edgecolors="black" if s.pareto else "none", linewidths=1.5, alpha=0.85, zorder=3)
        ax.annotate(s.name, (x, y), xytext=(6, 6), textcoords="offset points", fontsize=8)
    frontier = sorted((s.headline.p50_ms, _error(s)) for s in points if s.pareto)
    if len(frontier) > 1:
        xs, ys = zip(*frontier)
        ax.step(xs, ys, where="post", color=FRONTIER, lw=2, zorder=2, label="Pareto frontier")
    tolerance = (report.evaluation.get("tolerance") or {}).get("cosine_min")
    if tolerance is not None:
        ax.axhline(1 - tolerance, color=FAILED, ls="--", lw=1, label=f"tolerance (cosine {tolerance})")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(bottom=0)  # an error is never negative: symlog's axis otherwise runs below 0
    ax.set_xlabel(f"p50 latency, ms (batch {report.headline_batch})")
    ax.set_ylabel("accuracy error (1 − worst mean cosine)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    note = ("<p class='note'>The frontier: stages within tolerance that no other stage beats on both "
            f"{' and '.join(html.escape(a) for a in report.frontier_axes)}. Point area is the model's size on disk "
            "(shown, not an axis); gold = on the frontier; red X = out of tolerance (never on the frontier).</p>")
    return _svg(fig, "pareto") + note


def _latency_curves(report: RunReport) -> list[tuple[str, dict[str, list[tuple[int, Latency]]]]]:
    """(title, {stage: [(x, latency)]}): one chart for batch_sizes (when several) and one per swept dim."""
    charts: dict[str, dict[str, list[tuple[int, Latency]]]] = {}
    on_batch = _sweeps_of_the_batch(report)
    for s in report.stages:
        if s.status != "ok":
            continue
        seen: set[tuple[str, int]] = set()
        for lat in s.latency:
            if lat.sweep is None or lat.sweep in on_batch:  # a sweep of the batch dim is the batch-size chart
                title, x = "Latency vs batch size", lat.batch_size
                if (title, x) in seen:
                    continue
                seen.add((title, x))
            else:
                title, x = f"Latency vs {lat.sweep}", lat.sweep_value if lat.sweep_value is not None else lat.batch_size
            charts.setdefault(title, {}).setdefault(s.name, []).append((x, lat))
    return [(title, curves) for title, curves in charts.items() if max(len(v) for v in curves.values()) > 1]


def _sweeps_of_the_batch(report: RunReport) -> set[str]:
    """Swept dims whose every point sets the batch size (sweep value = batch size): the same curve as
    `batch_sizes`' own, drawn once (report.html showed "latency vs batch size" and "latency vs batch")."""
    points: dict[str, list[bool]] = {}
    for s in report.stages:
        for lat in s.latency:
            if lat.sweep is not None:
                points.setdefault(lat.sweep, []).append(lat.sweep_value == lat.batch_size)
    return {sweep for sweep, same in points.items() if all(same)}


def _curves_svg(curves: dict[str, list[tuple[int, Latency]]], title: str) -> str:
    fig = _figure(10, 4)
    left, right = fig.subplots(1, 2)
    for i, (name, points) in enumerate(curves.items()):
        points = sorted(points, key=lambda p: p[0])
        xs = [x for x, _ in points]
        style = dict(marker="o", ms=4, color="#555" if name == EAGER else PALETTE[i % len(PALETTE)], ls="--" if name == EAGER else "-")
        left.plot(xs, [lat.p50_ms for _, lat in points], label=name, **style)
        right.plot(xs, [lat.throughput for _, lat in points], label=name, **style)
    what = title.removeprefix("Latency vs ")
    for ax, ylabel in ((left, "p50 latency, ms"), (right, "throughput, samples/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    return _svg(fig, re.sub(r"\W+", "-", title.lower()))


# --- helpers -------------------------------------------------------------------------------


def _p50(s: StageResult | None) -> float | None:
    lat = s.headline if s else None
    return lat.p50_ms if lat else None


def _error(s: StageResult) -> float:
    return s.accuracy.error if s.accuracy else 0.0


_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
.meta, .note { color: #666; font-size: .9em; }
table { border-collapse: collapse; font-size: .85em; margin-top: .5em; }
th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: right; white-space: nowrap; }
div.wide { overflow-x: auto; max-width: 100%; } table.stages { font-size: .78em; }
table.stages th { white-space: normal; vertical-align: bottom; } table.stages td { padding: .25em .4em; }
th { background: #f5f5f5; } td:nth-child(-n+4) { text-align: left; }
figure.plot { margin: 1em 0; } figure.plot svg { max-width: 100%; height: auto; }
code { background: #f3f3f3; padding: 0 .2em; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
</body>
</html>
"""
