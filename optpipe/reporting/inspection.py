"""Look inside a finished run, as data: what a stage is (inspect) and what a pass changed (diff).

Reads only the run folder (through reporting/run_access.py: report.json and
stages/<name>/model.onnx), so it works on a run copied to another machine and never
recomputes a stage. reporting/inspection_text.py renders these for the terminal;
the CLI commands `optpipe inspect` and `optpipe diff` are thin views of both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optpipe.core.errors import RunFolderError
from optpipe.graph.stats import graph_diff
from optpipe.recipe.schema import Tolerance
from optpipe.core.results import Latency, StageResult
from optpipe.evaluation import openvino_runtime
from optpipe.reporting.run_access import (  # noqa: F401  (re-exported: the CLI and the pipeline read them here)
    SAMPLE_INPUTS_COUNT, SAMPLE_INPUTS_FILE, StageHandle, open_run, parse_stage_ref, sample_inputs, save_sample_inputs,
    stage_handle, stage_order,
)


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
        "status": result.verdict,  # out-of-tolerance apart from ok, as in the report
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
    folder = handle.run_dir / "stages" / handle.name
    if openvino_runtime.is_ir(folder):  # never had a model.onnx: not "missing"
        return (f"an OpenVINO IR stage ({folder / openvino_runtime.IR_FILE}); the graph sections describe ONNX "
                "stages only: its runtime, precision and int8 layers are in the pass info below")
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
            "status": result.verdict,  # out-of-tolerance apart from ok, as in the report
            "nodes": graph["nodes"] if graph else None,
            "fused": sum(graph["fused_ops"].values()) if graph else None,
            "precision": _mix_text(graph["precision_mix"]) if graph else "",
            "p50_ms": result.headline.p50_ms if result.headline else None,
            "cosine": result.accuracy.worst_cosine if result.accuracy else None,
            "accuracy": result.accuracy.figure(label="") if result.accuracy else None,  # R² where the cosine cannot tell
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
            "shape": shape_text(lat.shape),
            "p50_ms": (before.p50_ms, lat.p50_ms),
            "p90_ms": (before.p90_ms, lat.p90_ms),
            "speedup": before.p50_ms / lat.p50_ms if lat.p50_ms else None,
        })
    return rows


def _latency_key(lat: Latency) -> tuple:
    return lat.sweep, lat.batch_size, tuple(sorted((k, tuple(v)) for k, v in lat.shape.items()))


def shape_text(shape: dict[str, list[int]]) -> str:
    first = next(iter(shape.values()), [])
    return "x".join(str(d) for d in first)


def _mix_text(mix: dict[str, float]) -> str:
    return " ".join(f"{dt} {share:.0%}" for dt, share in mix.items() if share >= 0.005)

