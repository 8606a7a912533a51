"""Text views of inspections and diffs for the terminal (`optpipe inspect`, `optpipe diff`)."""
from __future__ import annotations

from typing import Any

from optpipe.reporting.inspection import StageDiff, shape_text


def render_run(rows: list[dict[str, Any]]) -> str:
    header = ["stage", "pass", "after", "status", "nodes", "fused", "weights", "p50 ms", "cosine", "size MB"]
    table = [[
        r["stage"], r["pass"], r["parent"] or "", r["status"], _n(r["nodes"]), _n(r["fused"]), r["precision"],
        _f(r["p50_ms"], ".2f"), r["accuracy"] or "", _f(r["size_bytes"] / 1e6 if r["size_bytes"] else None, ".1f"),
    ] for r in rows]
    return _table(header, table)


def render_inspection(data: dict[str, Any]) -> str:
    lines = [f"stage {data['stage']} ({data['pass']}{', after ' + data['parent'] if data['parent'] else ''}): {data['status']}"]
    if data["reason"]:
        lines.append(f"  reason: {data['reason']}")
    if data.get("missing"):
        lines.append(f"  note: {data['missing']}")
    graph = data["graph"]
    if graph:
        lines += ["", "inputs / outputs:"]
        for kind in ("inputs", "outputs"):
            for v in graph[kind]:
                lines.append(f"  {kind[:-1]:6} {v['name']}: {v['dtype']} [{', '.join(str(d) if d is not None else '?' for d in v['shape'])}]")
        lines += ["", f"nodes {graph['nodes']}, initializers {graph['initializers']}, parameters {graph['parameters']:,}, "
                      f"weights {_bytes(graph['weight_bytes'])}, opsets {_kv(graph['opsets'])}"]
        lines.append("bytes by dtype: " + (", ".join(f"{dt} {_bytes(n)} ({graph['precision_mix'].get(dt, 0):.0%})" for dt, n in graph["bytes_by_dtype"].items()) or "none"))
        lines.append("fused ops (com.microsoft): " + (_kv(graph["fused_ops"]) or "none"))
        if graph["precision_ops"]:
            lines.append("precision boundaries: " + _kv(graph["precision_ops"]))
        lines += ["", "op histogram:"]
        lines += _columns([f"{op} {n}" for op, n in sorted(graph["ops"].items(), key=lambda kv: (-kv[1], kv[0]))])
    lines += ["", "metrics:"]
    lines += _metric_lines(data)
    if data["pass_info"]:
        lines += ["", "pass info: " + _kv({k: v for k, v in data["pass_info"].items() if not isinstance(v, (dict, list))} )]
    return "\n".join(lines)


def render_diff(diff: StageDiff) -> str:
    lines = [f"diff {diff.a.label} -> {diff.b.label}"]
    lines += [f"  note: {n}" for n in diff.notes]
    g = diff.graph
    if g:
        lines += ["", "graph:"]
        for key in ("nodes", "initializers", "parameters", "weight_bytes"):
            before, after = g[key]
            lines.append(f"  {key:13} {before:>12,} -> {after:>12,}  ({_pct(before, after)})")
        lines.append("  ops added:    " + (_kv(g["ops_added"], "+") or "none"))
        lines.append("  ops removed:  " + (_kv(g["ops_removed"], "-") or "none"))
        fused_a, fused_b = g["fused_ops"]
        if fused_a or fused_b:
            lines.append(f"  fused ops:    {_kv(fused_a) or 'none'} -> {_kv(fused_b) or 'none'}")
        lines.append("  weights by dtype: " + ", ".join(f"{dt} {_bytes(b)} -> {_bytes(a)}" for dt, (b, a) in g["bytes_by_dtype"].items()))
        if g["io_changed"]:
            lines.append("  the inputs/outputs changed (names, dtypes or dims)")
    if diff.accuracy:
        lines += ["", "accuracy (against the reference):"]
        for row in diff.accuracy:
            if "within_tolerance" in row:
                a, b = row["within_tolerance"]
                lines.append(f"  within tolerance: {a} -> {b}")
                continue
            text = f"  {row['output']}: cosine {_f(row['cosine'][0], '.5f')} -> {_f(row['cosine'][1], '.5f')} ({_delta(*row['cosine'])}), "
            text += f"max abs {_f(row['max_abs'][0], '.3g')} -> {_f(row['max_abs'][1], '.3g')}"
            if row["top1"][1] is not None:
                text += f", top-1 {_f(row['top1'][0], '.3f')} -> {_f(row['top1'][1], '.3f')}"
            lines.append(text)
    if diff.latency:
        lines += ["", "latency (p50 ms; speed-up > 1x means B is faster):"]
        lines.append(_table(["batch", "shape", "sweep", "A p50", "B p50", "A p90", "B p90", "speed-up"], [
            [str(r["batch_size"]), r["shape"], r["sweep"], _f(r["p50_ms"][0], ".2f"), _f(r["p50_ms"][1], ".2f"),
             _f(r["p90_ms"][0], ".2f"), _f(r["p90_ms"][1], ".2f"), _f(r["speedup"], ".2f") + "x"] for r in diff.latency
        ], indent="  "))
    a_size, b_size = diff.size
    if a_size and b_size:
        lines += ["", f"size on disk: {_bytes(a_size)} -> {_bytes(b_size)} ({_pct(a_size, b_size)})"]
    if diff.layers is not None:
        lines += ["", diff.layers.render()]
    return "\n".join(lines)


def _metric_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    acc = data["accuracy"]
    if acc:
        verdict = "within tolerance" if acc["within_tolerance"] else "OUT OF TOLERANCE: " + "; ".join(acc["violations"])
        lines.append(f"  accuracy vs {acc['reference']} on {acc['samples']} samples: {verdict}")
        for out in acc["outputs"]:
            top1 = f", top-1 {out['top1']:.3f}" if out.get("top1") is not None else ""
            top1 += f", R² {out['explained']:.5f} (the cosine cannot tell)" if out.get("explained") is not None else ""
            lines.append(f"    {out['name']}: cosine mean {out['cosine_mean']:.5f} (min {out['cosine_min']:.5f}), max abs {out['max_abs']:.3g}, mean abs {out['mean_abs']:.3g}{top1}")
    for lat in data["latency"]:
        sweep = f" [{lat['sweep']} sweep]" if lat.get("sweep") else ""
        lines.append(f"  latency batch {lat['batch_size']} {shape_text(lat['shape'])}{sweep}: p50 {lat['p50_ms']:.2f} ms, p90 {lat['p90_ms']:.2f}, "
                     f"p99 {lat['p99_ms']:.2f}, {lat['throughput']:.1f} samples/s ({lat['provider']})")
    if data["size_bytes"]:
        lines.append(f"  size on disk {_bytes(data['size_bytes'])}")
    memory = data.get("memory")
    if memory:
        parts = [f"host RSS +{_bytes(memory['host_rss_bytes'])}" if memory.get("host_rss_bytes") is not None else "",
                 f"device +{_bytes(memory['device_bytes'])}" if memory.get("device_bytes") is not None else ""]
        lines.append("  peak memory of the session: " + ", ".join(p for p in parts if p))
    return lines or ["  none (the stage did not finish)"]


def _table(header: list[str], rows: list[list[str]], indent: str = "") -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _columns(items: list[str], per_line: int = 6) -> list[str]:
    return ["  " + ", ".join(items[i : i + per_line]) for i in range(0, len(items), per_line)]


def _kv(mapping: dict, sign: str = "") -> str:
    return ", ".join(f"{k} {sign}{v}" for k, v in mapping.items())


def _pct(before: float, after: float) -> str:
    return f"{(after - before) / before * 100:+.1f}%" if before else "n/a"


def _delta(before: float | None, after: float | None) -> str:
    return f"{after - before:+.5f}" if before is not None and after is not None else "n/a"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _n(value: int | None) -> str:
    return "" if value is None else str(value)


def _f(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)
