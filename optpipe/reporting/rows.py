"""The stage table as data: one `StageRow` per stage, rendered by both report.md and report.html.

A column is one entry of `COLUMNS`: a header and a function from the row's context (the
stage, its parent, the eager baseline) to a `Cell`. Adding a column to both views is one
line here. A cell carries its text and a tone (ok / out of tolerance / failed) that each
view shows its own way (a ⚠ in Markdown, a colour in HTML).
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Callable, Literal, Optional

from optpipe.evaluation.figure_warnings import BARELY, BELOW_HALF, MEANINGLESS, NEAR_ZERO, TIED
from optpipe.evaluation.latency import BUSY_SPREAD
from optpipe.evaluation.openvino_runtime import PRECISION_NAMES
from optpipe.evaluation.speed_verdict import SLOWER_THAN_PARENT
from optpipe.core.results import Accuracy, RunReport, StageResult

Tone = Optional[Literal["ok", "out", "failed"]]


@dataclass(frozen=True)
class Cell:
    text: str = ""
    tone: Tone = None


@dataclass(frozen=True)
class RowContext:
    stage: StageResult
    parent: Optional[StageResult]
    eager: Optional[StageResult]
    eager_typical_ms: Optional[float] = None  # median of the eager p50s timed beside the stages
    cpu: Optional[dict] = None  # the machine's CPU record (report.machine["cpu"])


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[RowContext], Cell]


@dataclass(frozen=True)
class StageRow:
    stage: StageResult
    cells: list[Cell]


def stage_rows(report: RunReport) -> list[StageRow]:
    eager = report.stage(report.baseline) if report.baseline else None
    beside = _eager_beside(report)
    typical = float(median(beside)) if beside else None
    rows = []
    for stage in report.stages:
        context = RowContext(stage, report.stage(stage.parent) if stage.parent else None, eager, typical,
                             report.machine.get("cpu"))
        rows.append(StageRow(stage, [column.cell(context) for column in columns(report)]))
    return rows


def columns(report: RunReport | None = None) -> list[Column]:
    """The table's columns: the generation column only where a stage was measured by generation."""
    if report is not None and any(s.generation for s in report.stages):
        return COLUMNS[:-3] + [Column("generation", _generation)] + COLUMNS[-3:]
    return COLUMNS


def headers(report: RunReport | None = None) -> list[str]:
    return [column.header for column in columns(report)]


def _generation(c: RowContext) -> Cell:
    """TTFT and decode tokens/s per batch size, agreement and perplexity: a decoder's own figures."""
    g = c.stage.generation
    if g is None:
        return Cell()
    parts = [f"TTFT {g.rows[0].ttft_ms:.1f} ms"] if g.rows else []
    parts += [f"{r.decode_tokens_per_s:.0f} tok/s b{r.batch_size}" + _eager_ratio(r) for r in g.rows]
    if g.perplexity is not None:
        parts.append(f"ppl {g.perplexity:.2f}")
    parts.append(f"{g.weights} weights")
    return Cell(" · ".join(parts), "out" if g.weights == "random" else None)


def _eager_ratio(row) -> str:
    """Decode tokens/s against eager's, timed interleaved with it (absent on eager's own row)."""
    if not row.eager_decode_tokens_per_s:
        return ""
    return f" ({row.decode_tokens_per_s / row.eager_decode_tokens_per_s:.2f}x eager)"


def generation_note(report: RunReport) -> str:
    if not any(s.generation for s in report.stages):
        return ""
    g = next(s.generation for s in report.stages if s.generation)
    reference = next((s.accuracy.reference for s in report.stages if s.generation and s.accuracy), report.reference)
    note = (f" Decoder measured by greedy generation ({g.new_tokens} new tokens after {g.prompts} prompts, {g.tokens}): "
            "p50/p90 ms are one decode step of the batch (ms per generated token at batch 1), 'vs eager' against PyTorch "
            f"eager with its KV cache{' timed interleaved' if not _eager_apart(report) else ''}; accuracy is next-token "
            f"agreement over {reference}'s generated tokens.")
    if g.weights == "random":
        note += " ⚠ Random weights (built from a config): agreement and perplexity mean nothing here."
    return note


def table_note(report: RunReport) -> str:
    return (f"Latency at batch {report.headline_batch}; 'vs' columns are speed-ups (>1x is faster); Δ columns are against "
            f"the stage's parent; 'vs eager' is against PyTorch eager {_eager_how(report)}; "
            "⚠busy: the machine was busy while it was timed, don't trust that ratio." + "".join(" " + n for n in timing_notes(report))
            + _reuse_note(report) + generation_note(report))


def _reuse_note(report: RunReport) -> str:
    """What 'pass cached' / 'eval cached' mean, where a row says one of them."""
    if not any(s.reused in ("pass cached", "eval cached") for s in report.stages):
        return ""
    return (" 'pass cached': the stage's model came from the cache and its figures were measured again "
            "('eval cached': the reverse).")


def timing_notes(report: RunReport) -> list[str]:
    """How far PyTorch eager moved between stages, and which figures were timed on a busy machine."""
    notes = []
    beside = _eager_beside(report)
    if beside:
        lo, hi = min(beside), max(beside)
        where = "after" if _eager_apart(report) else "beside"
        notes.append(f"PyTorch eager, re-timed {where} each of {len(beside)} stages: p50 {lo:.2f} to {hi:.2f} ms (spread {(hi - lo) / lo:.0%}).")
        if (hi - lo) / median(beside) > BUSY_SPREAD:
            notes.append("⚠ PyTorch eager's own speed moved that much between stages: the machine was busy, so speed-ups "
                         "against eager are not comparable across stages; rerun with --force on a quieter machine"
                         + (", or with more memory free (eager is then timed interleaved)." if where == "after" else "."))
    for s in report.stages:
        busy = [lat for lat in s.latency if lat.unreliable]
        if busy:
            loads = [lat.load_average for lat in busy if lat.load_average is not None]
            load = f", load average {max(loads):.1f}" if loads else ""
            notes.append(f"⚠ {s.name}: {len(busy)} of {len(s.latency)} latency figures unreliable ({busy[0].unreliable}{load}).")
    notes.extend(_budget_notes(report))
    return notes


def _budget_notes(report: RunReport) -> list[str]:
    """Figures whose timing stopped at evaluate.figure_budget_s before their median was known to ±3%: how well it is known."""
    notes = []
    for s in report.stages:
        short = [lat for lat in s.latency if lat.stopped == "budget" and lat.interval is not None]
        if short:
            widest = max(short, key=lambda lat: lat.interval)
            notes.append(f"{s.name}: {len(short)} of {len(s.latency)} latency figures stopped at the time budget "
                         f"(evaluate.figure_budget_s), the widest p50 known to ±{widest.interval:.0%} after "
                         f"{widest.iterations} calls (batch {widest.batch_size}).")
    return notes


# --- cells -----------------------------------------------------------------------------------


def out_of_tolerance(stage: StageResult) -> bool:
    return bool(stage.accuracy and not stage.accuracy.within_tolerance)


def guard_figure(accuracy: Accuracy) -> str:
    """The pass's guard figure beside the report's, where the two disagree (the stricter is the verdict)."""
    guard = accuracy.guard
    if guard is None or (guard.within_tolerance and abs(guard.cosine - accuracy.worst_cosine) < 1e-3):
        return ""
    return f" (guard {guard.cosine:.5f}, {guard.numerics})"


def _status(c: RowContext) -> Cell:
    s = c.stage
    tone: Tone = "failed" if s.status != "ok" else "out" if out_of_tolerance(s) else "ok"
    return Cell(s.verdict + (f" ({s.reused})" if s.reused else ""), tone)


def _cosine(c: RowContext) -> Cell:
    accuracy = c.stage.accuracy
    if not accuracy:
        return Cell()
    text = accuracy.figure(label="") + guard_figure(accuracy) + meaningless_mark(accuracy)
    task_notes = accuracy.task.notes if accuracy.task else []  # marked in the task metric's cell
    warned = any(w not in task_notes for w in accuracy.warnings)
    return Cell(text, None if accuracy.within_tolerance and not warned else "out")


def meaningless_mark(accuracy: Accuracy) -> str:
    """Marks a figure measured on outputs that are ~0, or barely depend on the inputs (see the Warnings section)."""
    near_zero = [w for w in accuracy.warnings if NEAR_ZERO in w]
    if near_zero:
        return " (meaningless: outputs ~0)" if any(MEANINGLESS in w for w in near_zero) else " (some outputs ~0)"
    if any(BELOW_HALF in w for w in accuracy.warnings):
        return " (output below fp16's range)"
    if any(TIED in w for w in accuracy.warnings):
        return " (meaningless: tied logits)"
    if any(MEANINGLESS in w and "random weights" in w for w in accuracy.warnings):
        return " (meaningless: random weights)"
    if any(MEANINGLESS in w for w in accuracy.warnings):
        return " (meaningless: inputs barely matter)"
    return " (some outputs barely depend on the inputs)" if any(BARELY in w for w in accuracy.warnings) else ""


TASK_HEADLINES = {"top1_agreement": "top-1 agree", "top5_agreement": "top-5 agree", "class_agreement": "class agree",
                  "map50": "mAP@0.5", "next_token_agreement": "next-token agree", "perplexity_ratio": "ppl ×",
                  "token_cosine": "token cosine", "pixel_agreement": "pixel agree", "miou": "mIoU"}


def _task(c: RowContext) -> Cell:
    """The task metric (evaluate.task), which is the verdict when the recipe names one."""
    task = c.stage.accuracy.task if c.stage.accuracy else None
    if task is None:
        return Cell()
    shown = {TASK_HEADLINES[k]: v for k, v in task.metrics.items() if k in TASK_HEADLINES and v is not None}
    shown.update({f"labels {k}": v for k, v in task.labels.items() if not k.startswith("reference") and v is not None})
    text = " · ".join(f"{k} {v:.3f}" for k, v in shown.items()) or "not measured"
    if task.own_bounds:  # held to the stage's tolerance.task, not evaluate.task's: say so where the figure is
        text += " (its own bounds: " + ", ".join(f"{k} {v:g}" for k, v in task.own_bounds.items()) + ")"
    # Marked also where a figure is not measured, or means nothing: the Warnings section says which and why.
    return Cell(text, "out" if task.violations or task.notes else None)


def grouped_warnings(stages: list[StageResult]) -> dict[str, list[str]]:
    """Each distinct warning with the stages it concerns (an input-insensitive eval set concerns them all)."""
    grouped: dict[str, list[str]] = {}
    for s in stages:
        for w in s.warnings:
            grouped.setdefault(w, []).append(s.name)
    return grouped


def _cosine_delta(c: RowContext) -> Cell:
    if not (c.parent and c.parent.accuracy and c.stage.accuracy):
        return Cell()
    if c.stage.accuracy.cosine_blind:  # the cosine judges no output: its change says nothing
        return Cell()
    return Cell(f"{c.stage.accuracy.worst_cosine - c.parent.accuracy.worst_cosine:+.5f}")


def _max_abs(c: RowContext) -> Cell:
    accuracy = c.stage.accuracy
    return Cell(_f(max((o.max_abs for o in accuracy.outputs), default=None) if accuracy else None, ".2e"))


def _p50(stage: Optional[StageResult]) -> Optional[float]:
    headline = stage.headline if stage else None
    return headline.p50_ms if headline else None


def _p90(stage: StageResult) -> Optional[float]:
    return stage.headline.p90_ms if stage.headline else None


def _peak_mb(stage: StageResult) -> Optional[float]:
    return stage.memory.host_rss_bytes / 1e6 if stage.memory and stage.memory.host_rss_bytes is not None else None


RUNTIME_LABELS = {"CPUExecutionProvider": "ort-cpu", "CUDAExecutionProvider": "ort-cuda", "TensorrtExecutionProvider": "ort-tensorrt",
                  "pytorch-cpu": "pytorch"}


def runtime_label(stage: StageResult, machine: Optional[dict] = None) -> str:
    """What measured the row: ONNX Runtime's provider, OpenVINO (with the precision it ran float ops at), PyTorch."""
    provider = stage.headline.provider if stage.headline else None
    if provider is None:
        return ""
    hint = stage.info.get("inference_precision") if provider.startswith("openvino") else None
    label = RUNTIME_LABELS.get(provider, provider) + (f" {hint}" if hint else "")
    # The machine's class heads the report; a row timed on another (OpenVINO held lower by
    # ONEDNN_MAX_CPU_ISA, a Ray node of another kind) names its own.
    row_class, machine_class = stage.headline.cpu_class, (machine or {}).get("class")
    return label + (f" [{row_class}]" if row_class and machine_class and row_class != machine_class else "")


def _precision(c: RowContext) -> Cell:
    """The MAC mix (int8 / fp16 / fp32), flagged when the stage carries a warning of its graph or pass (an
    accuracy warning flags the accuracy cell instead: "fp32 100% ⚠" on a model that ignores its inputs
    pointed at the wrong column); an OpenVINO IR's compute layers per precision the runtime runs them
    at (it has no ONNX graph to count MACs on)."""
    flag = "out" if _graph_warnings(c.stage) else None
    if c.stage.coverage:
        return Cell(c.stage.coverage.summary(), flag)
    layers = c.stage.info.get("compute_layer_precisions")
    if not layers:
        return Cell()
    total = sum(layers.values())
    by_name: dict[str, int] = {}
    for runtime, count in layers.items():
        name = PRECISION_NAMES.get(runtime, runtime)
        by_name[name] = by_name.get(name, 0) + count
    mix = " · ".join(f"{name} {count}/{total}" for name, count in sorted(by_name.items(), key=lambda kv: -kv[1]))
    return Cell(f"{mix} layers", flag)


def _graph_warnings(stage: StageResult) -> list[str]:
    """The stage's warnings less its accuracy's and the speed verdict's (each flags its own column)."""
    accuracy = set(stage.accuracy.warnings) if stage.accuracy else set()
    return [w for w in stage.warnings if w not in accuracy and not w.startswith(SLOWER_THAN_PARENT)]


def _eager_apart(report: RunReport) -> bool:
    return any(s.headline is not None and s.headline.eager_apart for s in report.stages)


def _eager_how(report: RunReport) -> str:
    """How eager's figure beside each stage's was timed (evaluate.eager_timing, resolved per run)."""
    if _eager_apart(report):
        return ("timed right after that stage, alone (eager_timing: apart: its model is loaded again once the stage's "
                "runtime is released, so the two are never in memory together: the recipe asks, or the two would not fit "
                "this machine's memory; figures from other seconds, compare them with care)")
    return "timed interleaved with that stage"


def _eager_beside(report: RunReport) -> list[float]:
    return [s.headline.eager_p50_ms for s in report.stages if s.headline and s.headline.eager_p50_ms]


def _vs_eager(c: RowContext) -> Cell:
    """Against the eager figure timed beside this stage; else (results from before that) the eager row's own.

    Marked busy also when that eager figure is far from eager's typical one across the stages."""
    headline = c.stage.headline
    if headline is not None and headline.eager_p50_ms:
        ratio = _ratio(headline.eager_p50_ms, headline.p50_ms)
        if c.eager_typical_ms and abs(headline.eager_p50_ms - c.eager_typical_ms) > BUSY_SPREAD * c.eager_typical_ms:
            return Cell(ratio + " ⚠busy")
        return _busy_marked(ratio, c.stage)
    if c.stage is c.eager and headline is not None and c.eager_typical_ms and \
            abs(headline.p50_ms - c.eager_typical_ms) > BUSY_SPREAD * c.eager_typical_ms:
        return Cell("1.00x ⚠busy")  # eager's own figure disagrees with eager timed beside the stages
    return _busy_marked(_ratio(_p50(c.eager), _p50(c.stage)), c.stage, c.eager)


def _busy_marked(text: str, *stages: Optional[StageResult]) -> Cell:
    busy = text and any(s is not None and s.headline is not None and s.headline.unreliable for s in stages)
    return Cell(text + " ⚠busy" if busy else text)


def _ratio(base: Optional[float], value: Optional[float]) -> str:
    return f"{base / value:.2f}x" if base and value else ""


def _pct(before: Optional[int], after: Optional[int]) -> str:
    return f"{(after - before) / before * 100:+.0f}%" if before and after else ""


def _f(value: Optional[float], fmt: str) -> str:
    return "" if value is None else format(value, fmt)


COLUMNS: list[Column] = [
    Column("stage", lambda c: Cell(c.stage.name)),
    Column("pass", lambda c: Cell(c.stage.pass_name)),
    Column("after", lambda c: Cell(c.stage.parent or "")),
    Column("status", _status),
    Column("p50 ms", lambda c: Cell(_f(_p50(c.stage), ".2f"))),
    Column("p90 ms", lambda c: Cell(_f(_p90(c.stage), ".2f"))),
    Column("vs eager", _vs_eager),
    Column("vs parent", lambda c: _busy_marked(_ratio(_p50(c.parent), _p50(c.stage)), c.stage, c.parent)),
    Column("cosine", _cosine),
    Column("Δ cosine", _cosine_delta),
    Column("max abs", _max_abs),
    Column("size MB", lambda c: Cell(_f(c.stage.size_bytes / 1e6 if c.stage.size_bytes else None, ".1f"))),
    Column("Δ size", lambda c: Cell(_pct(c.parent.size_bytes if c.parent else None, c.stage.size_bytes))),
    Column("peak mem MB", lambda c: Cell(_f(_peak_mb(c.stage), ".0f"))),
    Column("task metric", _task),
    Column("precision (MACs)", _precision),
    Column("runtime", lambda c: Cell(runtime_label(c.stage, c.cpu))),
    Column("frontier", lambda c: Cell("★" if c.stage.pareto else "")),
]
