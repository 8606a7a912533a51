"""Look inside a finished run: what a stage is (inspect) and what a pass changed (diff).

Reads only the run folder (report.json and stages/<name>/model.onnx), so it works
on a run copied to another machine and never recomputes a stage. The CLI commands
`optpipe inspect` and `optpipe diff` are thin views of the functions here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from optpipe.errors import RunFolderError
from optpipe.graph.stats import describe_graph, graph_diff
from optpipe.results import Latency, StageResult
from optpipe.recipe import Tolerance
from optpipe.reporting.run_report import RunReport

#: A few evaluation samples saved in the run folder, so a layer-wise comparison uses real inputs.
SAMPLE_INPUTS_FILE = "eval_inputs.npz"
SAMPLE_INPUTS_COUNT = 4


# --- finding runs and stages ---------------------------------------------------------------


def open_run(path: str | Path) -> RunReport:
    run_dir = Path(path)
    if not (run_dir / "report.json").is_file():
        raise RunFolderError(f"'{run_dir}' is not a run folder (no report.json); pass the output folder of `optpipe compile`")
    try:
        return RunReport.load(run_dir)
    except ValueError as exc:
        raise RunFolderError(f"'{run_dir / 'report.json'}' is not a readable optpipe report ({str(exc).splitlines()[0]}); rerun `optpipe compile`") from None


@dataclass
class StageHandle:
    """One stage of one run: its report row and, for ONNX stages, its model in the run folder."""

    run_dir: Path
    report: RunReport
    result: StageResult
    show_run: bool = False

    @property
    def name(self) -> str:
        return self.result.name

    @property
    def label(self) -> str:
        return f"{self.run_dir}:{self.name}" if self.show_run else self.name

    @property
    def model_path(self) -> Path | None:
        path = self.run_dir / "stages" / self.name / "model.onnx"
        return path if path.is_file() else None

    @cached_property
    def graph(self) -> dict[str, Any] | None:
        """describe_graph of the stage's model; None for PyTorch eager.

        Counts and bytes come from the initializers' dims and dtypes, so the weights stay on disk."""
        if self.model_path is None:
            return None
        import onnx

        return describe_graph(onnx.load(str(self.model_path), load_external_data=False))


def stage_handle(run_dir: str | Path, name: str, report: RunReport | None = None) -> StageHandle:
    run_dir = Path(run_dir)
    report = report or open_run(run_dir)
    result = report.stage(name)
    if result is None:
        from optpipe.recipe import suggest

        names = ", ".join(s.name for s in report.stages)
        raise RunFolderError(f"run '{run_dir}' has no stage '{name}'{suggest(name, [s.name for s in report.stages])}; its stages are: {names}")
    return StageHandle(run_dir, report, result)


def parse_stage_ref(text: str, default_run: Path | None) -> StageHandle:
    """'STAGE' (in default_run) or 'RUN:STAGE' (a stage of another run folder)."""
    run_part, sep, stage = text.rpartition(":")
    if sep and run_part and (Path(run_part) / "report.json").is_file():
        handle = stage_handle(run_part, stage)
        handle.show_run = True
        return handle
    if default_run is None:
        raise RunFolderError(f"'{text}' names no run folder; write it as RUN:STAGE, e.g. runs/minilm:simplify")
    return stage_handle(default_run, text)


def stage_order(report: RunReport) -> list[StageResult]:
    return list(report.stages)


# --- inspect -------------------------------------------------------------------------------


def inspect_stage(handle: StageHandle) -> dict[str, Any]:
    """A stage as data: its report row (metrics) and, for ONNX stages, its graph."""
    result = handle.result
    info = {k: v for k, v in result.info.items() if k != "graph"}
    return {
        "run": str(handle.run_dir),
        "stage": result.name,
        "pass": result.pass_name,
        "parent": result.parent,
        "status": result.status,
        "reason": result.reason,
        "size_bytes": result.size_bytes,
        "accuracy": result.accuracy.model_dump(mode="json") if result.accuracy else None,
        "latency": [lat.model_dump(mode="json") for lat in result.latency],
        "memory": _memory_of(result),
        "pass_info": info,
        "graph": handle.graph,
        "missing": _missing_copy(handle),
    }


def _missing_copy(handle: StageHandle) -> str | None:
    """Why the graph sections are absent, when a finished ONNX stage's copy is gone from the run folder."""
    if handle.result.status != "ok" or handle.result.hash is None or handle.model_path is not None:
        return None
    return (f"{handle.run_dir / 'stages' / handle.name / 'model.onnx'} is missing, so its graph sections are not shown; "
            "rerun the same compile to restore the run folder")


def inspect_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """One summary row per stage of a run (graph facts beside the metrics)."""
    report = open_run(run_dir)
    rows = []
    for result in report.stages:
        handle = StageHandle(Path(run_dir), report, result)
        graph = handle.graph
        rows.append({
            "stage": result.name,
            "pass": result.pass_name,
            "parent": result.parent,
            "status": result.status,
            "nodes": graph["nodes"] if graph else None,
            "fused": sum(graph["fused_ops"].values()) if graph else None,
            "precision": _mix_text(graph["precision_mix"]) if graph else "",
            "p50_ms": result.headline.p50_ms if result.headline else None,
            "cosine": result.accuracy.worst_cosine if result.accuracy else None,
            "size_bytes": result.size_bytes,
        })
    return rows


def _memory_of(result: StageResult) -> Any:
    memory = getattr(result, "memory", None)
    return memory.model_dump(mode="json") if memory is not None else None


# --- diff ----------------------------------------------------------------------------------


@dataclass
class StageDiff:
    """What changed from stage A to stage B: graph, accuracy, latency, size, and optionally per layer."""

    a: StageHandle
    b: StageHandle
    graph: dict[str, Any] | None
    accuracy: list[dict[str, Any]]
    latency: list[dict[str, Any]]
    size: tuple[int | None, int | None]
    notes: list[str] = field(default_factory=list)
    layers: Any = None  # optpipe.evaluation.layerwise.LayerComparison when asked for

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.label,
            "b": self.b.label,
            "graph": self.graph,
            "accuracy": self.accuracy,
            "latency": self.latency,
            "size_bytes": list(self.size),
            "notes": self.notes,
            "layers": self.layers.to_dict() if self.layers is not None else None,
        }


def diff_stages(a: StageHandle, b: StageHandle, layers: bool = False, samples: int = 2, tolerance: Tolerance | None = None) -> StageDiff:
    notes = []
    graph = graph_diff(a.graph, b.graph) if a.graph and b.graph else None
    if graph is None:
        notes.append("no graph diff: " + " and ".join(f"'{h.label}' has no ONNX model" for h in (a, b) if h.graph is None))
    if a.result.accuracy and b.result.accuracy and a.result.accuracy.reference != b.result.accuracy.reference:
        notes.append(f"accuracy is measured against different references ({a.result.accuracy.reference} vs {b.result.accuracy.reference})")
    if a.report.machine.get("processor") != b.report.machine.get("processor"):
        notes.append("the two runs were timed on different machines: latency ratios compare machines too")
    diff = StageDiff(a, b, graph, _accuracy_rows(a.result, b.result), _latency_rows(a.result.latency, b.result.latency), (a.result.size_bytes, b.result.size_bytes), notes)
    if layers:
        diff.layers = layer_comparison(a, b, samples, tolerance)
    return diff


def layer_comparison(reference: StageHandle, candidate: StageHandle, samples: int = 2, tolerance: Tolerance | None = None):
    """Intermediate tensors of `candidate` against the same-named ones of `reference`, on saved eval inputs."""
    from optpipe.evaluation.layerwise import compare_layers

    for handle in (reference, candidate):
        if handle.model_path is None:
            raise RunFolderError(f"'{handle.label}' has no ONNX model to compare layer by layer; pick two ONNX stages")
    feeds = sample_inputs(candidate.run_dir, samples) or sample_inputs(reference.run_dir, samples)
    if feeds is None:
        raise RunFolderError(
            f"run '{candidate.run_dir}' has no {SAMPLE_INPUTS_FILE}; rerun `optpipe compile` to save evaluation inputs for the layer-wise view"
        )
    tolerance = tolerance or Tolerance.model_validate(candidate.report.evaluation.get("tolerance", {}))
    threads = int(candidate.report.evaluation.get("threads", 2))
    return compare_layers(reference.model_path, candidate.model_path, feeds, tolerance, threads=threads)


def save_sample_inputs(run_dir: Path, arrays: dict[str, np.ndarray], count: int = SAMPLE_INPUTS_COUNT) -> Path:
    """Keep the first evaluation samples beside the report (small: a few samples)."""
    path = run_dir / SAMPLE_INPUTS_FILE
    tmp = run_dir / f".{SAMPLE_INPUTS_FILE}.tmp.npz"
    np.savez(tmp, **{name: array[:count] for name, array in arrays.items()})
    tmp.replace(path)
    return path


def sample_inputs(run_dir: Path, count: int) -> dict[str, np.ndarray] | None:
    path = run_dir / SAMPLE_INPUTS_FILE
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name][:count] for name in data.files}


def _accuracy_rows(a: StageResult, b: StageResult) -> list[dict[str, Any]]:
    if not a.accuracy or not b.accuracy:
        return []
    by_name = {o.name: o for o in a.accuracy.outputs}
    rows = []
    for out in b.accuracy.outputs:
        before = by_name.get(out.name)
        rows.append({
            "output": out.name,
            "cosine": (before.cosine_mean if before else None, out.cosine_mean),
            "max_abs": (before.max_abs if before else None, out.max_abs),
            "top1": (before.top1 if before else None, out.top1),
        })
    rows.append({"output": "(within tolerance)", "within_tolerance": (a.accuracy.within_tolerance, b.accuracy.within_tolerance)})
    return rows


def _latency_rows(a: list[Latency], b: list[Latency]) -> list[dict[str, Any]]:
    """Latencies of A and B paired by the same batch and input shapes; speed-up = A / B."""
    by_key = {_latency_key(lat): lat for lat in a}
    rows = []
    for lat in b:
        before = by_key.get(_latency_key(lat))
        if before is None:
            continue
        rows.append({
            "batch_size": lat.batch_size,
            "sweep": lat.sweep or "",
            "shape": _shape_text(lat.shape),
            "p50_ms": (before.p50_ms, lat.p50_ms),
            "p90_ms": (before.p90_ms, lat.p90_ms),
            "speedup": before.p50_ms / lat.p50_ms if lat.p50_ms else None,
        })
    return rows


def _latency_key(lat: Latency) -> tuple:
    return lat.sweep, lat.batch_size, tuple(sorted((k, tuple(v)) for k, v in lat.shape.items()))


def _shape_text(shape: dict[str, list[int]]) -> str:
    first = next(iter(shape.values()), [])
    return "x".join(str(d) for d in first)


def _mix_text(mix: dict[str, float]) -> str:
    return " ".join(f"{dt} {share:.0%}" for dt, share in mix.items() if share >= 0.005)


# --- text views ----------------------------------------------------------------------------


def render_run(rows: list[dict[str, Any]]) -> str:
    header = ["stage", "pass", "after", "status", "nodes", "fused", "weights", "p50 ms", "cosine", "size MB"]
    table = [[
        r["stage"], r["pass"], r["parent"] or "", r["status"], _n(r["nodes"]), _n(r["fused"]), r["precision"],
        _f(r["p50_ms"], ".2f"), _f(r["cosine"], ".5f"), _f(r["size_bytes"] / 1e6 if r["size_bytes"] else None, ".1f"),
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
            lines.append(f"    {out['name']}: cosine mean {out['cosine_mean']:.5f} (min {out['cosine_min']:.5f}), max abs {out['max_abs']:.3g}, mean abs {out['mean_abs']:.3g}{top1}")
    for lat in data["latency"]:
        sweep = f" [{lat['sweep']} sweep]" if lat.get("sweep") else ""
        lines.append(f"  latency batch {lat['batch_size']} {_shape_text(lat['shape'])}{sweep}: p50 {lat['p50_ms']:.2f} ms, p90 {lat['p90_ms']:.2f}, "
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
