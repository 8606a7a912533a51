"""Views of a search's report section (report.json `search`, built by optpipe.search.report) and
of the machines that measured: Markdown for report.md, HTML for report.html, text for `inspect`."""
from __future__ import annotations

import html

def render_search_markdown(search: dict | None, hardware: dict | None = None) -> list[str]:
    lines: list[str] = []
    if hardware and len(hardware.get("classes", [])) > 1:
        lines += ["## Machines", "", *[f"- {c}" for c in hardware["classes"]], ""]
        lines += [f"Frontier: {hardware.get('reason') or hardware.get('frontier')}", ""]
    if not search:
        return lines
    budget = search["budget"]
    lines += ["## Search", "",
              f"{search['strategy']}" + (f" ({search['sampler']}, objectives: {', '.join(search['objectives'])})" if search.get("sampler") else "")
              + f" over {search['space_size']} points; budget: {_budget_text(budget)}; stopped: {search['stopped']}; {len(search['trials'])} trials "
              f"({search['counts']}) in {search['wall_s']} s.", ""]
    keys = list(search["space"])
    lines += ["| # | " + " | ".join(keys) + " | stage | status | p50 ms | cosine | size KB | frontier |",
              "|" + "---|" * (len(keys) + 7)]
    for t in search["trials"]:
        status = t["status"] + (f" (repeat of {t['repeat_of']})" if t.get("repeat_of") else "")
        lines.append("| " + " | ".join([
            str(t["number"]), *[str(t["params"].get(k, "—")) for k in keys], f"`{t['stage']}`" if t["stage"] else "— (not run)", status,
            _f(t.get("p50_ms"), ".3f"), _f(t.get("cosine"), ".5f"), _f(t["size_bytes"] / 1e3 if t.get("size_bytes") else None, ".1f"),
            "★" if t["stage"] in search["frontier"] else "",
        ]) + " |")
    lines.append("")
    if search.get("frontier_note"):
        lines += [f"Frontier refused: {search['frontier_note']}", ""]
    else:
        status = {t["stage"]: t["status"] for t in search["trials"]}
        lines += [f"Frontier over all trials ({', '.join(search['objectives'])}; ★ in the table, ⚠ out of tolerance): "
                  + (", ".join(f"`{n}`" + (" ⚠" if status.get(n) != "ok" else "") for n in search["frontier"]) or "none"), "",
                  "Frontier within tolerance: " + (", ".join(f"`{n}`" for n in search.get("frontier_within_tolerance", [])) or "none"), ""]
    best = search.get("best")
    lines += [f"Best within tolerance ({best['rule']}): trial {best['number']}, `{best['stage']}`" if best
              else "Best within tolerance: none of the trials held the tolerance", ""]
    failed = [t for t in search["trials"] if t["status"] not in ("ok",) and not t.get("repeat_of")]
    if failed:
        lines += ["Trials that failed, were skipped or broke the tolerance:", ""]
        lines += [f"- trial {t['number']} ({t['status']}): {t.get('reason')}" for t in failed]
        lines.append("")
    lines += ["### Effect of each param", ""]
    for key, rows in search["effects"].items():
        lines += [f"`{key}`:", "", "| value | trials | within tolerance | best p50 ms | mean cosine | worst cosine |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['value']} | {r['trials']} | {r['within_tolerance']} | {_f(r['best_p50_ms'], '.3f')} | "
                  f"{_f(r['mean_cosine'], '.5f')} | {_f(r['worst_cosine'], '.5f')} |" for r in rows]
        lines.append("")
    return lines


def render_search_html(search: dict | None, hardware: dict | None = None) -> str:
    """The same tables as the Markdown view, as HTML (report.html's Search section)."""
    if not search and not (hardware and len(hardware.get("classes", [])) > 1):
        return ""
    text = "\n".join(render_search_markdown(search, hardware))
    return "<section><h2>Search</h2>\n" + _markdown_tables_to_html(text) + "\n</section>"


def _markdown_tables_to_html(text: str) -> str:
    out, table = [], []

    def flush():
        if table:
            head, *body = [r for r in table if not set(r.replace("|", "").strip()) <= {"-"}]
            cells = lambda row: [c.strip() for c in row.strip().strip("|").split("|")]  # noqa: E731
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cells(head)) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells(r)) + "</tr>" for r in body) + "</table>")
            table.clear()

    for line in text.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("## "):
            continue
        if line.startswith("### "):
            out.append(f"<h3>{html.escape(line[4:])}</h3>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)


def _f(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def render_trials_text(report) -> str:
    """`optpipe inspect RUN`'s list of a search's trials (empty when the run was no search)."""
    search = getattr(report, "search", None)
    if not search:
        return ""
    lines = [f"\nsearch: {search['strategy']}, {len(search['trials'])} trials ({search['counts']}), stopped: {search['stopped']}"]
    for t in search["trials"]:
        params = ", ".join(f"{k}={v}" for k, v in t["params"].items())
        figures = ", ".join(x for x in (_f(t.get("p50_ms"), ".3f") and f"p50 {t['p50_ms']:.3f} ms",
                                         _f(t.get("cosine"), ".5f") and f"cosine {t['cosine']:.5f}") if x)
        mark = " *frontier*" if t["stage"] in search["frontier"] else ""
        best = " *best*" if search.get("best") and search["best"]["number"] == t["number"] else ""
        reason = f" ({t['reason']})" if t["status"] != "ok" and t.get("reason") else ""
        lines.append(f"  trial {t['number']:>3} {t['status']}{reason}: {params} -> {t['stage'] or '(not run)'}  {figures}{mark}{best}")
    return "\n".join(lines)


def _budget_text(budget: dict) -> str:
    """'24 trials, 3600 s wall', '24 trials', or 'none' (not 'none trials, no s wall')."""
    parts = ([f"{budget['trials']} trials"] if budget.get("trials") else []) + (
        [f"{budget['wall_time_s']} s wall"] if budget.get("wall_time_s") else [])
    return ", ".join(parts) or "none"
