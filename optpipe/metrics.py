"""Per-stage results as data with a schema: accuracy, latency, and the stage row of the report."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field


class OutputAccuracy(BaseModel):
    name: str
    max_abs: float
    mean_abs: float
    cosine_mean: float
    cosine_min: float
    top1: Optional[float] = None
    finite: bool = True


class Accuracy(BaseModel):
    reference: str
    samples: int
    outputs: list[OutputAccuracy]
    within_tolerance: bool
    violations: list[str] = Field(default_factory=list)
    polygraphy_match: Optional[bool] = Field(None, description="Polygraphy's elementwise comparison at the recipe's max_abs")

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
    info: dict[str, Any] = Field(default_factory=dict)

    def latency_at(self, batch_size: int) -> Latency | None:
        return next((lat for lat in self.latency if lat.batch_size == batch_size), None)
