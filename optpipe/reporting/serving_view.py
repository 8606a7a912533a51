"""Views of report.json's `serving` section (written by `optpipe serve --bench`, optpipe.serving):
throughput and p99 vs concurrency per stage, with and without dynamic batching. Markdown for
report.md, HTML (an inline matplotlib SVG plus the table) for report.html."""
from __future__ import annotations

import html
from typing import Optional


def _series(serving: dict) -> dict[tuple[str, bool], list[dict]]:
    """(stage, dynamic batching) -> its points, by concurrency."""
    series: dict[tuple[str, bool], list[dict]] = {}
    for point in serving["points"]:
        series.setdefault((point["stage"], point["dynamic_batching"]), []).append(point)
    return {key: sorted(points, key=lambda p: p["concurrency"]) for key, points in series.items()}


def _label(stage: str, batching: bool) -> str:
    return f"{stage} ({'dynamic batching' if batching else 'no batching'})"


def _caption(serving: dict) -> str:
    cpu = serving.get("cpu", {})
    busy = [p for p in serving["points"] if p.get("busy")]
    flagged = f" ⚠busy: {len(busy)} of {len(serving['points'])} points were timed while other processes took the CPUs." if busy else ""
    return (f"{serving['server']}; {serving['protocol']}; {serving['duration_s']} s per point, interleaved; "
            f"{cpu.get('processor')} ({cpu.get('cores')} cores), load average {cpu.get('load_before', ['?'])[0]} before, "
            f"{cpu.get('load_after', ['?'])[0]} after; client and server share the machine.{flagged}")


def render_serving_markdown(serving: Optional[dict]) -> list[str]:
    if not serving:
        return []
    lines = ["## Serving: throughput vs concurrency", "", _caption(serving), "",
             "| stage | batching | clients | req/s | p50 ms | p99 ms | req/execution | errors | busy |", "|---|---|---|---|---|---|---|---|---|"]
    for (stage, batching), points in _series(serving).items():
        for p in points:
            lines.append(f"| `{stage}` | {'dynamic' if batching else 'none'} | {p['concurrency']} | {p['throughput_rps']:.1f} | "
                         f"{_f(p['p50_ms'])} | {_f(p['p99_ms'])} | {_f(p['requests_per_execution'], '.2f')} | {p['errors']} | "
                         f"{'⚠ ' + p['busy'] if p.get('busy') else ''} |")
    return lines + [""]


def render_serving_html(serving: Optional[dict]) -> str:
    if not serving:
        return ""
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in (
            stage, "dynamic" if batching else "none", p["concurrency"], f"{p['throughput_rps']:.1f}", _f(p["p50_ms"]),
            _f(p["p99_ms"]), _f(p["requests_per_execution"], ".2f"), p["errors"], "⚠ " + p["busy"] if p.get("busy") else "")) + "</tr>"
        for (stage, batching), points in _series(serving).items() for p in points)
    table = ("<table><tr><th>stage</th><th>batching</th><th>clients</th><th>req/s</th><th>p50 ms</th><th>p99 ms</th>"
             f"<th>req/execution</th><th>errors</th><th>busy</th></tr>{rows}</table>")
    return ("<section><h2>Serving: throughput vs concurrency</h2>\n" + _plot(serving)
            + f"<p class='note'>{html.escape(_caption(serving))}</p>\n{table}\n</section>")


def _plot(serving: dict) -> str:
    """req/s (left) and p99 ms (right) against the number of concurrent clients, one line per stage and
    batching mode (solid: dynamic batching; dashed: none); a busy point is drawn hollow."""
    from optpipe.reporting.plot_svg import figure, svg

    fig = figure(10, 3.6)
    left, right = fig.subplots(1, 2)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    stages = sorted({stage for stage, _ in _series(serving)})
    for (stage, batching), points in _series(serving).items():
        colour = colours[stages.index(stage) % len(colours)]
        style = "-" if batching else "--"
        xs = [p["concurrency"] for p in points]
        for ax, key in ((left, "throughput_rps"), (right, "p99_ms")):
            ys = [p[key] if p[key] is not None else float("nan") for p in points]
            ax.plot(xs, ys, style, color=colour, label=_label(stage, batching))
            for x, y, p in zip(xs, ys, points):
                ax.plot([x], [y], "o", color=colour, markerfacecolor="none" if p.get("busy") else colour)
    for ax, ylabel in ((left, "requests / s"), (right, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p["concurrency"] for p in serving["points"]}))
        ax.get_xaxis().set_major_formatter("{x:.0f}")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    return svg(fig, "serving")


def _f(value, fmt: str = ".3f") -> str:
    return "—" if value is None else format(value, fmt)
