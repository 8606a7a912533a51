"""PyTorch eager as an evaluator keeps it between stages (evaluate.eager_timing, resolved by
plan/source_preflight.eager_timing): one holder for the one-forward Evaluator and the GenerationEvaluator.

- interleaved: built once and held for the run, timed beside every stage;
- apart: built for each use and dropped after it, with the run's copy of the torch model (`release`), so
  that its weights and a stage's runtime are never in memory together (docs/memory.md, sixth round)."""
from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

Runner = TypeVar("Runner")


class HeldEager(Generic[Runner]):
    def __init__(self, eager_timing: str = "interleaved"):
        self.apart = eager_timing == "apart"
        self._build: Optional[Callable[[], Runner]] = None
        self._release: Callable[[], object] = lambda: None
        self._held: Optional[Runner] = None

    def set_source(self, build: Callable[[], Runner], release: Callable[[], object] = lambda: None) -> None:
        """`build`: a new runner (the torch model loaded, where it was released); `release`: drops the run's model."""
        self._build, self._release = build, release

    @property
    def has_source(self) -> bool:
        return self._build is not None

    def get(self) -> Runner:
        """The held runner, else a new one from the source (whose errors reach the caller)."""
        if self._held is None:
            if self._build is None:
                raise RuntimeError("PyTorch eager is not available as a baseline")
            self._held = self._build()
        return self._held

    def drop_apart(self) -> None:
        """Apart: the runner and the run's model go, before the next stage builds its runtime."""
        if self.apart and self._held is not None:
            self._held = None
            self._release()
