"""Results as data with a schema: a stage's accuracy, latency and memory, a target's artifact, and the run report.

A leaf module: the pipeline, the targets and both report views (reporting/run_report.py
for Markdown, reporting/html.py for HTML) read these types; none of them is imported here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import computed_field, BaseModel, ConfigDict, Field, PrivateAttr

from optpipe.core.artifact import ModelArtifact

from optpipe.core.errors import OptpipeError, PassCrashed, UserInputError
from optpipe.graph.coverage import Coverage


class Result(BaseModel):
    """Every figure survives report.json: an infinite error (NaN outputs, outputs of unlike shapes) is written as the
    string "Infinity" and read back as inf. Pydantic's default writes null, which the float fields then refuse:
    `optpipe report`, `inspect` and `export` could not read the run again."""

    model_config = ConfigDict(ser_json_inf_nan="strings")


class OutputAccuracy(Result):
    name: str
    max_abs: float
    mean_abs: float
    cosine_mean: float
    cosine_min: float
    top1: Optional[float] = None
    finite: bool = True
    beyond_tolerance: Optional[float] = Field(None, description="share of elements outside max_abs + rtol * |reference| (where rtol is set)")
    input_sensitivity: Optional[float] = Field(None, description="the reference's spread across samples relative to its magnitude; "
                                               "near 0: the output hardly depends on the input")
    equal_share: Optional[float] = Field(None, description="an integer or boolean output (class ids, token ids, masks): the share "
                                         "of its elements equal to the reference's")
    explained: Optional[float] = Field(None, description="where the cosine cannot tell (a constant output meets its bound): the "
                                       "share of the reference's variation across samples it reproduces (R²), which holds it")
    constant_cosine: Optional[float] = Field(None, description="with `explained`: the cosine the reference's mean scores")
    shapes: Optional[tuple[list[int], list[int]]] = Field(None, description="the candidate's and the reference's shapes where they "
                                                          "differ (a length that depends on the data): nothing compares elementwise, "
                                                          "every figure reads as no agreement")


class TaskAccuracy(Result):
    """The task's metrics (evaluate.task) against the reference stage and, where the data has labels, the labels."""

    kind: str
    output: str
    metrics: dict[str, Optional[float]] = Field(description="candidate against the reference stage")
    labels: dict[str, Optional[float]] = Field(default_factory=dict, description="candidate and reference against the labels")
    violations: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list, description="what could not be measured, and why")
    own_bounds: dict[str, float] = Field(default_factory=dict, description="the stage's own bounds (tolerance.task) it was held to")

    @property
    def headline(self) -> float | None:
        """The task's agreement with the reference in one number (1 = the same), the worst of its key metrics."""
        keys = {"classification": ("top1_agreement",), "detection": ("class_agreement", "map50"),
                "segmentation": ("pixel_agreement",),
                "language-model": ("next_token_agreement",), "embeddings": ("token_cosine",)}.get(self.kind, ())
        values = [self.metrics[k] for k in keys if self.metrics.get(k) is not None]
        if self.kind == "language-model" and values and self.metrics.get("perplexity_ratio"):
            values.append(min(1.0, 1.0 / self.metrics["perplexity_ratio"]))  # a decoder's error: disagreement or perplexity
        return min(values) if values else None


class GuardCheck(Result):
    """The figure a pass's accuracy guard measured, shown beside the report's own (see evaluation/guard.py)."""

    numerics: str = Field(description="what computed it, e.g. emulated FP16 storage")
    cosine: float
    max_abs: Union[float, str]
    within_tolerance: bool
    gave_up: Optional[str] = None


class Accuracy(Result):
    reference: str
    samples: int
    outputs: list[OutputAccuracy]
    within_tolerance: bool
    violations: list[str] = Field(default_factory=list)
    polygraphy_match: Optional[bool] = Field(None, description="Polygraphy's elementwise comparison (atol/rtol per output); False is a violation")
    guard: Optional[GuardCheck] = Field(None, description="the pass's own guard figure; the stricter of the two is the verdict")
    task: Optional[TaskAccuracy] = Field(None, description="the task metric; when present it is the verdict")
    warnings: list[str] = Field(default_factory=list, description="why these figures may mean less than they seem (e.g. input-insensitive outputs)")
    export_mismatch: Optional[str] = Field(
        None, description="PyTorch eager's row, where the reference is the export: why the export does not compute what eager "
                          "does on the evaluation data, by the export's own self-check rule (None: it does, or not checked)")

    @property
    def worst_cosine(self) -> float:
        """The worst mean cosine of the float outputs it judges (`explained` holds the others), of all where it judges
        none; of every output where all are integer or boolean (held by their equal share, `error`)."""
        floats = [o for o in self.outputs if o.equal_share is None]
        return min(o.cosine_mean for o in [o for o in floats if o.explained is None] or floats or self.outputs)

    @property
    def cosine_blind(self) -> bool:
        """Every float output is held by R² (optpipe.evaluation.variation): the cosine judges none of them."""
        floats = [o for o in self.outputs if o.equal_share is None]
        return bool(floats) and all(o.explained is not None for o in floats)

    def figure(self, label: str = "cosine ") -> str:
        """In words (console, report): the cosine, and R² where it cannot tell."""
        explained = min((o.explained for o in self.outputs if o.explained is not None), default=None)
        if explained is None:
            return f"{label}{self.worst_cosine:.5f}"
        return f"R² {explained:.5f} (cosine cannot tell)" if self.cosine_blind else f"{label}{self.worst_cosine:.5f}, R² {explained:.5f}"

    @property
    def error(self) -> float:
        """One number for 'how far from the reference' (the Pareto axis): 1 - the task's headline metric where the
        recipe names a task, else 1 - the worst of the float outputs' mean cosine, the integer outputs' equal share
        and (1 + R²) / 2 where the cosine cannot tell (its error budget, variation.explained_bound)."""
        headline = self.task.headline if self.task else None
        if headline is None:
            figures = [o.equal_share if o.equal_share is not None else (1 + o.explained) / 2 for o in self.outputs
                       if o.equal_share is not None or o.explained is not None]
            headline = min([self.worst_cosine, *figures])
        return max(0.0, 1.0 - headline)


class Latency(Result):
    batch_size: int
    shape: dict[str, list[int]]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float = Field(description="samples per second at p50")
    iterations: int
    provider: str
    sweep: Optional[str] = Field(None, description="the dim this point of a sweep varies; None for the batch_sizes measurements")
    sweep_value: Optional[int] = Field(None, description="the swept dim's value at this point")
    spread: Optional[float] = Field(None, description="run-to-run spread: (max - min) / p50 of the per-block medians")
    interval: Optional[float] = Field(None, description="half-width of the p50's 95% interval (order statistics), as a fraction of it; None with too few runs")
    stopped: Optional[Literal["interval", "budget", "iterations"]] = Field(
        None, description="why adaptive timing stopped: the interval within ±3%, evaluate.figure_budget_s spent, or the "
        "iterations cap; None when timing was not adaptive")
    load_average: Optional[float] = Field(None, description="the machine's 1-minute load average while timed")
    others_cpu: Optional[float] = Field(
        None, description="share of this process's CPUs that other processes used while timed (Linux; None elsewhere or when too short to tell)")
    throttled: Optional[float] = Field(
        None, description="share of this process's CPU time its container's CPU quota held it back while timed (cgroup "
        "cpu.stat); None without a quota")
    unreliable: Optional[str] = Field(None, description="why the machine looked busy while this was timed (tail, spread); None if steady")
    eager_p50_ms: Optional[float] = Field(None, description="PyTorch eager p50 timed with this figure, same inputs (see eager_apart)")
    eager_p90_ms: Optional[float] = Field(None, description="PyTorch eager p90 timed with this figure")
    eager_apart: bool = Field(
        False, description="eager's figure was timed right after this one, alone (evaluate.eager_timing: apart), not "
        "interleaved with it: its model and this stage's runtime were not in memory together")
    cpu_class: Optional[str] = Field(
        None, description="the CPU class the runtime ran on (optpipe.hardware.cpu_features; OpenVINO's under ONEDNN_MAX_CPU_ISA)")

    @property
    def speedup_vs_eager(self) -> Optional[float]:
        """Against the eager figure timed beside this one (None where eager was not timed beside it)."""
        return self.eager_p50_ms / self.p50_ms if self.eager_p50_ms and self.p50_ms else None


class GenerationRow(Result):
    """Greedy generation at one batch size, medians over the rounds; eager's timed with it (interleaved, or right
    after it where its Latency row says eager_apart)."""

    batch_size: int
    ttft_ms: float = Field(description="time to first token: the prefill over the prompt")
    decode_tokens_per_s: float = Field(description="generated tokens per second after the first, all rows of the batch")
    eager_ttft_ms: Optional[float] = None
    eager_decode_tokens_per_s: Optional[float] = None


class Generation(Result):
    """A decoder measured by generation (evaluate.generation): the figures its row and report.json show."""

    weights: Literal["random", "checkpoint", "unknown"] = Field(
        description="random: built from a config (seeded), agreement and perplexity then mean nothing; checkpoint: read from the "
        "model's files (real weights where that checkpoint was trained); unknown: a factory or ONNX source")
    tokens: str = Field(description="how the prompts and text became token ids (a tokenizer, or UTF-8 bytes)")
    prompts: int
    new_tokens: int
    prompt_tokens: int = Field(description="tokens of each batch-1 prompt, the shortest")
    rows: list[GenerationRow]
    next_token_agreement: Optional[float] = Field(None, description="teacher-forced greedy agreement with eager over its generated tokens")
    perplexity: Optional[float] = None
    eager_perplexity: Optional[float] = None
    text_tokens: int = Field(0, description="tokens the perplexity covers")
    peak_rss_bytes: Optional[int] = Field(None, description="peak RSS above the process's before, while loading and generating")

    def row(self, batch: int) -> Optional[GenerationRow]:
        return next((r for r in self.rows if r.batch_size == batch), None)


class Memory(Result):
    """Peak memory while a stage's session is created and timed, above what the process held before."""

    host_rss_bytes: Optional[int] = Field(None, description="peak resident set size increase of this process")
    device_bytes: Optional[int] = Field(None, description="peak device memory increase (GPU providers)")


def headline_latency(latency: list[Latency]) -> Latency | None:
    """The headline latency of a stage or target, read here only: the first batch_sizes measurement
    (the evaluation measures batch_sizes first; sweep points come after and are never the headline)."""
    return next((lat for lat in latency if lat.sweep is None), None)


ErrorKind = Literal["input", "stage", "internal"]


def error_kind(exc: BaseException) -> ErrorKind:
    """A failure's kind from what was raised: "input" only for errors.UserInputError, which the places
    that know the input is the user's raise (model loading, forward on the recipe's inputs, data)."""
    if isinstance(exc, PassCrashed):  # a bug, met in a stage's worker process
        return "internal"
    return "input" if isinstance(exc, UserInputError) else "stage"


class MeasuredResult(Result):
    """What a stage and a target share: the verdict read from their `status` and `accuracy`, and the
    headline of their `latency` (both subclasses declare those fields)."""

    @computed_field  # in report.json beside `status`: an "ok" run that broke its tolerance is not "ok"
    @property
    def verdict(self) -> str:
        """ok | out-of-tolerance | failed | skipped: `status` says whether the stage ran, this what it is worth
        (out-of-tolerance: it ran and was measured, and broke the stage's tolerance; exit code unchanged)."""
        if self.status != "ok":
            return self.status
        return "out-of-tolerance" if self.accuracy is not None and not self.accuracy.within_tolerance else "ok"

    @property
    def headline(self) -> Latency | None:
        return headline_latency(self.latency)


class StageResult(MeasuredResult):
    name: str
    pass_name: str
    parent: Optional[str] = None
    status: Literal["ok", "failed", "skipped"]
    cached: bool = Field(False, description="the stage's model came from the cache (its pass did not run)")
    evaluation_cached: Optional[bool] = Field(None, description="its accuracy and latency figures came from the cache; None: not evaluated")
    reason: Optional[str] = None
    not_run: bool = Field(False, description="skipped by its pass's rule for this machine (Pass.skip_reason, e.g. OpenVINO "
                          "int8 on a CPU without VNNI), or after such a stage: not a failure")
    error_kind: Optional[ErrorKind] = Field(None, description="why a failed stage failed: input (the user's model or data; exit 2), "
                                            "stage (the pass could not do its work), internal (a bug in optpipe; the log has the traceback)")
    log: Optional[str] = None
    artifact: Optional[str] = None
    hash: Optional[str] = None
    size_bytes: Optional[int] = None
    duration_s: Optional[float] = None
    accuracy: Optional[Accuracy] = None
    latency: list[Latency] = Field(default_factory=list)
    pareto: bool = False
    memory: Optional[Memory] = None
    info: dict[str, Any] = Field(default_factory=dict)
    coverage: Optional[Coverage] = Field(None, description="share of weights and MACs per precision, float compute left and why")
    generation: Optional[Generation] = Field(None, description="evaluate.generation: TTFT, decode tokens/s, agreement, perplexity")
    warnings: list[str] = Field(default_factory=list, description="what makes this stage's 'ok' or figures less than they seem")
    measured_on: Optional[dict[str, Any]] = Field(None, description="the node that measured the figures (multi-node runs)")
    evaluation_s: Optional[float] = Field(None, description="seconds its evaluation took (searches and fan-out runs)")
    #: The stage's model in the cache while the run lasts (not part of report.json).
    _model: Optional[ModelArtifact] = PrivateAttr(None)

    @property
    def model(self) -> ModelArtifact | None:
        return self._model

    def with_model(self, model: ModelArtifact | None) -> "StageResult":
        self._model = model
        return self

    @property
    def reused(self) -> str | None:
        """What of a finished stage came from the cache: "cached" (its model and figures), "pass cached" (its model), "eval
        cached" (its figures), None (nothing). A stage not evaluated (yet) is judged by its pass alone."""
        if self.status != "ok":
            return None
        pass_cached, figures_cached = self.cached, self.evaluation_cached
        if figures_cached is None or pass_cached == figures_cached:
            return "cached" if pass_cached else None
        return "pass cached" if pass_cached else "eval cached"

    def latency_at(self, batch_size: int) -> Latency | None:
        return next((lat for lat in self.latency if lat.batch_size == batch_size and lat.sweep is None), None)

    def sweep(self, dim: str) -> list[Latency]:
        return [lat for lat in self.latency if lat.sweep == dim]


TargetStatus = Literal["ok", "skipped", "failed"]


class TargetResult(MeasuredResult):
    """One artifact written (or not) for one stage: the row of the report's targets and of the manifest."""

    kind: str
    stage: str
    status: TargetStatus
    reason: Optional[str] = Field(None, description="why it was skipped or failed; None when ok")
    path: Optional[str] = Field(None, description="the artifact folder, relative to the run (or export) folder")
    precision: Optional[str] = None
    provider: Optional[str] = Field(None, description="what measured the accuracy and latency below")
    accuracy: Optional[Accuracy] = None
    latency: list[Latency] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict, description="file (relative to path) -> sha256")
    hash: Optional[str] = Field(None, description="one hash over the files")
    details: dict[str, Any] = Field(default_factory=dict)
    built_on: Optional[dict[str, Any]] = Field(None, description="the node that built (and measured) it: host, CPU, GPUs, Ray node")
    gpu_check: Optional[dict[str, Any]] = Field(
        None, description="a target with gpu_type: meant_for, built_on (GPU names), matches, warning (optpipe.targets.gpu_type)")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def describe(self) -> str:
        """One line for people: the status, and the reason where there is one."""
        return self.status if self.reason is None else f"{self.status}: {self.reason}"


SCHEMA_VERSION = 3  # 3: a stage's `verdict` (out-of-tolerance apart from ok), `frontier_axes`; 2: targets are TargetResult rows (status and reason apart)
#: What the Pareto frontier is taken over (README: "latency vs accuracy error"); size is shown, not an axis.
FRONTIER_AXES = ["p50 latency at the first batch size", "accuracy error (1 - worst cosine, or the task metric's)"]
EAGER = "pytorch-eager"


class RunReport(Result):
    """report.json: everything one compile measured. Built by reporting.run_report.build_report."""

    schema_version: int = SCHEMA_VERSION
    optpipe_version: str
    recipe: str
    created: str
    machine: dict[str, Any]
    evaluation: dict[str, Any]
    reference: Optional[str]
    baseline: Optional[str] = None
    stages: list[StageResult]
    data_warnings: list[str] = Field(default_factory=list, description="what the preflight said of the data sets every figure rests on")
    pareto: list[str] = Field(default_factory=list)
    frontier_axes: list[str] = Field(default_factory=lambda: list(FRONTIER_AXES),
                                     description="what `pareto` is over: stages within tolerance that no other beats on these")
    targets: list[TargetResult] = Field(default_factory=list)
    search: Optional[dict[str, Any]] = Field(None, description="a search's trials, frontier, best and param effects (optpipe.search)")
    hardware: Optional[dict[str, Any]] = Field(None, description="multi-node runs: the kinds of machine that measured, the frontier rule")
    serving: Optional[dict[str, Any]] = Field(None, description="`optpipe serve --bench`: throughput and p50/p99 per concurrency on a real server (optpipe.serving)")

    def stage(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.name == name), None)

    @property
    def failed(self) -> list[StageResult]:
        return [s for s in self.stages if s.status != "ok" and not s.not_run]

    @property
    def failed_targets(self) -> list[TargetResult]:
        return [t for t in self.targets if t.failed]

    @property
    def headline_batch(self) -> int:
        """The batch size of every stage's headline latency."""
        return (self.evaluation.get("batch_sizes") or [1])[0]

    @classmethod
    def load(cls, run_dir: Path) -> "RunReport":
        """report.json of a run; one that is not what optpipe writes (hand-edited, cut, another file) is a
        user error naming it, for every command that reads it (report, inspect, diff, export)."""
        path = run_dir / "report.json"
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise OptpipeError(f"'{path}' is not a readable optpipe report ({str(exc).splitlines()[0]}); rerun `optpipe compile`") from None
        if not isinstance(document, dict):
            raise OptpipeError(f"'{path}' is not a readable optpipe report (it holds a {type(document).__name__}, not an "
                               "object); rerun `optpipe compile`")
        version = document.get("schema_version")
        # Version 1 differs only in its targets rows: one without targets reads as is.
        if version != SCHEMA_VERSION and not (version == 1 and not document.get("targets")):
            raise OptpipeError(
                f"{run_dir / 'report.json'} has schema version {version}, this optpipe reads "
                f"{SCHEMA_VERSION}; rerun `optpipe compile` to write it again (cached stages are reused)"
            )
        try:
            return cls.model_validate(document)
        except ValueError as exc:  # pydantic's ValidationError: a field of the wrong kind
            errors = exc.errors() if hasattr(exc, "errors") else []
            what = (f"{'.'.join(str(part) for part in errors[0]['loc'])}: {errors[0]['msg']}" if errors
                    else str(exc).splitlines()[0])
            raise OptpipeError(f"'{path}' is not a readable optpipe report ({what}); rerun `optpipe compile`") from None
