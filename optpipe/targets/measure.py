"""Measuring an artifact the way the report measures stages: same inputs, same reference, same settings.

Used for artifacts whose numbers differ from their stage's (a TensorRT engine, an ORT format
model): accuracy against the reference stage's outputs on the evaluation set, latency
percentiles per batch size.
"""
from __future__ import annotations

from functools import cached_property
from typing import Callable, Optional

from optpipe.evaluation.accuracy import compare, run_onnx
from optpipe.cache.store import StageCache
from optpipe.evaluation.evaluator import Evaluator
from optpipe.evaluation.latency import Warmth, measure
from optpipe.core.results import Accuracy, Latency
from optpipe.recipe.schema import Tolerance
from optpipe.core.runtime import Feeds, Outputs
from optpipe.targets.base import StageView, TargetSettings


class Measurer:
    def __init__(self, targets: TargetSettings, cache: StageCache, reference: Optional[StageView], providers: str = "auto"):
        self.shapes = targets.shapes
        self.settings = targets.evaluate
        self.reference = reference
        self.evaluator = Evaluator(targets.evaluate, targets.shapes, cache, targets.eval_set, providers)

    @property
    def batches(self) -> list[Feeds]:
        return self.evaluator.accuracy_batches

    @cached_property
    def reference_outputs(self) -> Outputs:
        if self.reference is None:
            raise ValueError("no reference stage finished in this run")
        return run_onnx(self.reference.model_path, self.batches, self.settings.threads, self.evaluator.providers)

    def accuracy(self, outputs: Outputs, tolerance: Tolerance) -> Optional[Accuracy]:
        if self.reference is None:
            return None
        return compare(
            outputs, self.reference_outputs, self.evaluator.all_inputs, tolerance, self.reference.name, self.settings.top1
        )

    def latency(self, run: Callable[[Feeds], Outputs], provider: str) -> list[Latency]:
        sizes = self.settings.batch_sizes if self.shapes.batch_dim() else [len(self.batches[0][next(iter(self.batches[0]))])]
        warmth = Warmth()  # one runner over the batch sizes: after the first, a new shape needs one untimed call
        return [
            measure(run, self.evaluator.eval_set.first(size), self.settings.warmup, self.settings.iterations, self.settings.threads,
                    provider, warmth=warmth, adaptive=self.settings.adaptive, budget_s=self.settings.figure_budget_s)
            for size in sizes
        ]
