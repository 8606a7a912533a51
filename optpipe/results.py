"""Per-stage results as data with a schema: accuracy, latency, and the stage row of the report."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from optpipe.graph.coverage import Coverage


class OutputAccuracy(BaseModel):
    name: str
    max_abs: float
    mean_abs: float
    cosine_mean: float
    cosine_min: float
    top1: Optional[float] = None
    finite: bool = True


class GuardCheck(BaseModel):
    """The figure a pass's accuracy guard measured, shown beside the report's own (see evaluation/guard.py)."""

    numerics: str = Field(description="what computed it, e.g. emulated FP16 storage")
    cosine: float
    max_abs: Union[float, str]
    within_tolerance: bool
    gave_up: Optional[str] = None


class Accuracy(BaseModel):
    reference: str
    samples: int
    outputs: list[OutputAccuracy]
    within_tolerance: bool
    violations: list[str] = Field(default_factory=list)
    polygraphy_match: Optional[bool] = Field(None, description="Polygraphy's elementwise comparison at the recipe's max_abs")
    guard: Optional[GuardCheck] = Field(None, description="the pass's own guard figure; the stricter of the two is the verdict")

    @property
    def worst_cosine(self) -> float:
        return min(o.cosine_mean for o in self.outputs)

    @property
    def error(self) -> float:
        """One number for 'how far from the reference': 1 - the worst mean cosine."""
        return max(0.0, 1.0 - self.worst_cosine)


class Latency(BaseModel):
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
    load_average: Optional[float] = Field(None, description="the machine's 1-minute load average while timed")
    unreliable: Optional[str] = Field(None, description="why the machine looked busy while this was timed (tail, spread); None if steady")
    eager_p50_ms: Optional[float] = Field(None, description="PyTorch eager p50 timed interleaved with this figure, same inputs")
    eager_p90_ms: Optional[float] = Field(None, description="PyTorch eager p90 timed interleaved with this figure")

    @property
    def speedup_vs_eager(self) -> Optional[float]:
        """Against the eager figure timed beside this one (None where eager was not timed beside it)."""
        return self.eager_p50_ms / self.p50_ms if self.eager_p50_ms and self.p50_ms else None


class Memory(BaseModel):
    """Peak memory while a stage's session is created and timed, above what the process held before."""

    host_rss_bytes: Optional[int] = Field(None, description="peak resident set size increase of this process")
    device_bytes: Optional[int] = Field(None, description="peak device memory increase (GPU providers)")


class StageResult(BaseModel):
    name: str
    pass_name: str
    parent: Optional[str] = None
    status: Literal["ok", "failed", "skipped"]
    cached: bool = False
    reason: Optional[str] = None
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
    warnings: list[str] = Field(default_factory=list, description="what makes this stage's 'ok' or figures less than they seem")

    def latency_at(self, batch_size: int) -> Latency | None:
        return next((lat for lat in self.latency if lat.batch_size == batch_size and lat.sweep is None), None)

    def sweep(self, dim: str) -> list[Latency]:
        return [lat for lat in self.latency if lat.sweep == dim]
