"""One accuracy guard for every lossy pass: keep the nodes that break the tolerance in float.

A pass gives the guard a `convert(excluded_nodes)` callable (its own conversion, with
those nodes left in float) and the guard does the rest, the same way for every pass:

1. convert with the user's exclusions; measure against the pass's input on the
   evaluation set with the stage's tolerance (`evaluation.accuracy.compare`);
2. while out of tolerance and within its budget (`max_excluded` nodes, `guard_trials`
   conversions, `guard_seconds`): blame nodes by the error each *adds*
   (`evaluation.error_attribution`), try the nodes that overflow (all at once) or else
   the worst one in float, and keep the exclusion only if it improves the figure;
3. report what it did as a `GuardReport` (the stage's `info["guard"]`), including
   when and why it gave up.

The guard measures the numerics the deployed model will have (`numerics`, e.g. the
FP16-storage emulation), which can differ from what the report's evaluation provider
computes: `guard_verdict.fold_guard_verdict` makes the stricter of the two the stage's verdict.

A new pass uses it in about ten lines (mixed INT8/FP16, say)::

    class MixedParams(PassParams, GuardParams):
        ...

    class MixedPass(Pass[MixedParams]):
        def run(self, model, ctx):
            source = model.load()
            convert = lambda excluded: to_mixed(source, keep_float=excluded)
            result = AccuracyGuard(ctx, model, self.params, convert).run(self.params.exclude)
            save_model(result.model, ctx.workdir)
            return write_info(ctx.workdir, {"guard": result.report.model_dump(mode="json")})

`tests/test_guard.py` builds exactly such a third pass-like use on a hand-built graph.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

import onnx

from optpipe.core.artifact import save_model
from optpipe.evaluation import outputs_memo
from optpipe.evaluation.accuracy import compare, run_onnx
from optpipe.evaluation.guard_types import MAX_EXCLUDED_ALIASES, GuardParams, GuardReport, GuardStep, attempt_score  # noqa: F401  (the passes' names)
from optpipe.core.results import Accuracy

if TYPE_CHECKING:
    from optpipe.core.artifact import ModelArtifact
    from optpipe.evaluation.error_attribution import NodeBlame
    from optpipe.pass_infra.pass_base import PassContext
    from optpipe.recipe.schema import EvaluateSpec, ModelInputs

Model = Union[onnx.ModelProto, Path]
Convert = Callable[[list[str]], Model]


@dataclass
class GuardResult:
    model: Model
    excluded: list[str]  # the user's and the guard's
    accuracy: Accuracy
    report: GuardReport


class AccuracyGuard:
    """Measures `convert(excluded)` against the pass's input and widens `excluded` until the tolerance holds."""

    def __init__(
        self,
        ctx: "PassContext",
        source: "ModelArtifact",
        params: GuardParams,
        convert: Convert,
        *,
        numerics: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
        numerics_label: str = "ONNX Runtime CPU",
        candidates: Optional[set[str]] = None,
        tensor_in: Callable[[str, set[str]], Optional[str]] | None = None,
        node_facts: Callable[[str], dict] | None = None,
        graph: onnx.ModelProto | None = None,
    ):
        """numerics: turns a converted model into the one whose outputs are the deployed numerics.
        candidates: the only nodes the guard may keep in float (default: any).
        tensor_in(name, produced): the converted model's tensor holding the source tensor `name`.
        node_facts(node): what keeping that node in float costs (recorded in the steps).
        graph: the source graph with the node names `convert` understands (default: `source` loaded)."""
        self.ctx = ctx
        self.source = source
        self.params = params
        self.convert = convert
        self.numerics = numerics
        self.numerics_label = numerics_label
        self.candidates = candidates
        self.tensor_in = tensor_in or (lambda name, produced: name if name in produced else None)
        self.node_facts = node_facts or (lambda node: {})
        self._graph = graph
        settings = ctx.evaluate
        self.threads = settings.threads
        self.top1 = settings.top1
        self.task = settings.task  # the recipe's task metric is the guard's verdict too
        samples = ctx.eval_set()
        self.inputs = samples.arrays
        self.labels = samples.labels
        self.batches = list(samples.batches(accuracy_batch(ctx.inputs, settings)))
        self.rank_feeds = {name: array[: params.rank_samples] for name, array in self.inputs.items()}
        self.scratch: Path | None = None  # made on first use, removed by run()
        # Each conversion, measurement and ranking is a console step (issue 17), the batches counted.
        self.progress = getattr(ctx, "progress", None) or (lambda *_: None)
        self.conversions = 0
        self.reference = run_onnx(source.path, self.batches, self.threads, progress=self._counter("the input's outputs"))

    def run(self, excluded: list[str]) -> GuardResult:
        try:
            result = self._run(list(excluded))
            self._share_outputs(result.model)
            return result
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)  # the cache entry holds only the model
                self.scratch = None

    def _counter(self, what: str) -> Callable[[int, int], None]:
        return lambda done, total: self.progress(f"guard: {what} (batch)", done, total)

    def _convert(self, excluded: list[str]) -> Model:
        self.conversions += 1
        self.progress(f"guard: conversion {self.conversions} ({len(excluded)} nodes in float)", self.conversions,
                      self.params.guard_trials + 1)
        return self.convert(excluded)

    def _run(self, excluded: list[str]) -> GuardResult:
        started = time.perf_counter()
        model = self._convert(excluded)
        accuracy = self.measure(model)
        first = _step([], accuracy)
        steps: list[GuardStep] = []
        tried = set(excluded)
        by_guard: list[str] = []
        gave_up = None
        blamed: list["NodeBlame"] | None = None  # valid while the model is unchanged (a try was undone)
        while not accuracy.within_tolerance:
            gave_up = self._budget_spent(len(by_guard), len(steps), time.perf_counter() - started)
            if gave_up:
                break
            blamed = [b for b in blamed if b.node not in tried] if blamed is not None else self.blame(model, tried)
            overflowing = [b for b in blamed if b.overflow]
            pick = (overflowing or blamed[:1])[: self.params.max_excluded - len(by_guard)]
            if not pick:
                # No node adds error by itself (a small error spread over a few nodes, or one the blame
                # cannot see, e.g. at a graph output): the last converted nodes in float still hold.
                pick, gave_up = self._last_nodes(tried, len(by_guard))
                if not pick:
                    break
            nodes = [b.node for b in pick]
            tried.update(nodes)
            trial = self._convert(excluded + nodes)
            result = self.measure(trial)
            step = _step(pick, result, accuracy, facts={n: self.node_facts(n) for n in nodes})
            # The blame is local; an exclusion that buys nothing end to end is undone. An overflowing
            # node stays in float regardless: its fix may only show once its consumers are kept too.
            step.kept = bool(overflowing) or attempt_score(result) > attempt_score(accuracy)
            steps.append(step)
            self.ctx.log.info("guard tried %s in float: cosine %.5f, max abs %s, %s (kept: %s)", nodes, result.worst_cosine,
                              step.max_abs, "; ".join(result.violations) or "within tolerance", step.kept)
            if step.kept:
                excluded, by_guard, model, accuracy = excluded + nodes, by_guard + nodes, trial, result
                blamed = None  # a new model: blame again
        seconds = time.perf_counter() - started
        unconverted = self._all_kept(excluded)
        if unconverted:
            self.ctx.log.warning("guard: %s", unconverted)
        if not accuracy.within_tolerance:
            gave_up = gave_up or "the guard is off (guard: false)"
            self.ctx.log.warning(
                "guard gave up out of tolerance (%s, %s): %s", self.numerics_label, gave_up, "; ".join(accuracy.violations)
            )
        report = GuardReport(
            enabled=self.params.guard,
            numerics=self.numerics_label,
            held=accuracy.within_tolerance,
            cosine=round(accuracy.worst_cosine, 6),
            max_abs=_max_abs(accuracy),
            violations=accuracy.violations,
            first=first,
            excluded=by_guard,
            steps=steps,
            trials=len(steps),
            seconds=round(seconds, 2),
            gave_up=None if accuracy.within_tolerance else gave_up,
            unconverted=unconverted,
        )
        return GuardResult(model, excluded, accuracy, report)

    def _convertible(self) -> list[str]:
        """The nodes the pass converts, in graph order (the candidates, or every named node)."""
        if self._graph is None:
            self._graph = self.source.load()
        names = [node.name for node in self._graph.graph.node if node.name]
        return names if self.candidates is None else [n for n in names if n in self.candidates]

    def _last_nodes(self, tried: set[str], kept: int) -> tuple[list, str | None]:
        """The fallback when blame names no node: the last converted nodes not tried yet, as many as
        the budget allows; or no nodes and why the guard stops."""
        rest = [n for n in self._convertible() if n not in tried]
        if not rest:
            return [], ("every converted node was tried in float one by one and none bought accuracy; "
                        "the error is not in one place the guard can keep in float")
        room = self.params.max_excluded - kept
        if room <= 0:
            return [], (f"{kept} nodes kept in float, the limit (max_excluded: {self.params.max_excluded}); "
                        f"{len(rest)} converted nodes are left: raise max_excluded to {kept + len(rest)} to keep them all")
        ops = {node.name: node.op_type for node in self._graph.graph.node}
        return [_LastNode(name, ops.get(name, "?")) for name in rest[-room:]], None

    def _all_kept(self, excluded: list[str]) -> str | None:
        """A note when every node the pass converts stays in float: the stage then computes what its
        input computes (an int8 stage that is the FP32 model), which must be said, not implied."""
        convertible = self._convertible()
        if convertible and set(convertible) <= set(excluded):
            return (f"all {len(convertible)} node(s) this pass converts are kept in float: the stage computes what "
                    "its input does (no conversion left)")
        return None

    def _budget_spent(self, kept: int, trials: int, seconds: float) -> str | None:
        p = self.params
        if not p.guard:
            return "the guard is off (guard: false)"
        if kept >= p.max_excluded:
            return f"{kept} nodes kept in float, the limit (max_excluded: {p.max_excluded})"
        if trials >= p.guard_trials:
            return f"{trials} conversions tried, the limit (guard_trials: {p.guard_trials})"
        if seconds >= p.guard_seconds:
            return f"{seconds:.0f} s spent, over the budget (guard_seconds: {p.guard_seconds:g})"
        return None

    def measure(self, model: Model) -> Accuracy:
        """The model's outputs under the guard's numerics, against the pass's input."""
        outputs = run_onnx(self._path(self._numerics(model)), self.batches, self.threads,
                           progress=self._counter(f"outputs of conversion {self.conversions}"))
        return compare(outputs, self.reference, self.inputs, self.ctx.tolerance, "pass input", self.top1,
                       task=self.task, labels=self.labels)

    def blame(self, model: Model, skip: set[str]) -> list["NodeBlame"]:
        """Candidate nodes (not in `skip`) ranked by the error each adds, on a few samples."""
        from optpipe.evaluation.error_attribution import blame_nodes, float_activations, run_with_outputs
        from optpipe.evaluation.fp16_numerics import tensor_types

        self.progress("guard: rank the nodes by the error each adds", 0, 0)
        if self._graph is None:
            self._graph = self.source.load()
        source = self._graph
        converted = self._numerics(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)))
        produced = {out for node in converted.graph.node for out in node.output}
        pairs = {name: self.tensor_in(name, produced) for name in float_activations(source, tensor_types(source))}
        pairs = {name: other for name, other in pairs.items() if other}
        reference = run_with_outputs(source, list(pairs), self.rank_feeds, self.threads)
        values = run_with_outputs(converted, list(pairs.values()), self.rank_feeds, self.threads)
        candidate = {name: values[other] for name, other in pairs.items()}
        names = {node.name for node in source.graph.node}
        allowed = names if self.candidates is None else self.candidates
        return blame_nodes(source, reference, candidate, skip=skip | (names - allowed))

    def _numerics(self, model: Model) -> Model:
        if self.numerics is None:
            return model
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
        return self.numerics(proto)

    def _path(self, model: Model) -> Path:
        """A file of the model: saved as an artifact is (same bytes as the pass will publish: the
        outputs memo then finds the guard's outputs for the stage's evaluation)."""
        if isinstance(model, Path):
            return model
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # saving with external data rewrites the proto's initializers in place
        return save_model(copy, self._scratch() / "measured").path

    def _scratch(self) -> Path:
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix="guard-", dir=self.ctx.workdir))
        return self.scratch

    def _share_outputs(self, model: Model) -> None:
        """The final model's outputs, which the last measurement computed, filed under the content the
        published stage will have: a pass saves a converter's file (int8: ORT's quantizer output) again
        as an artifact, other bytes for the same model, and the stage's evaluation would compute them again.

        Only when the guard measured the model itself (no `numerics`); a proto is already measured in
        the artifact's layout (`_path`). Costs one load and save of the model (~0.2 s for MiniLM INT8)."""
        if self.numerics is not None or not isinstance(model, Path):
            return
        memo = outputs_memo.MEMO
        measured = outputs_memo.run_key(model, self.batches, self.threads)
        if measured is None or measured not in memo:
            return
        started = time.perf_counter()
        published = outputs_memo.published_digest(model, self._scratch() / "published")
        memo.alias(measured, outputs_memo.session_key(published, self.batches, self.threads))
        outputs_memo.log.debug("guard: final model's outputs filed under its published content (%.2f s)",
                               time.perf_counter() - started)


@dataclass(frozen=True)
class _LastNode:
    """A fallback pick (no blame figure): one of the last converted nodes, tried in float."""

    node: str
    op: str
    added_error: float = math.nan
    overflow: bool = False

    def reason(self) -> str:
        return "fallback: blame found no node adding error; one of the last converted nodes"


def accuracy_batch(shapes: ModelInputs, evaluate: EvaluateSpec) -> int:
    """The evaluation batch: evaluate's accuracy_batch, or the model's fixed batch when it has no batch dim."""
    if shapes.batch_dim():
        return evaluate.accuracy_batch
    first = shapes.inputs[0].shape[0] if shapes.inputs[0].shape else 1
    return first if isinstance(first, int) else 1


def _max_abs(accuracy: Accuracy) -> float | str:
    value = max((o.max_abs for o in accuracy.outputs), default=0.0)
    return float(value) if math.isfinite(value) else "inf"


def _step(blamed: list, accuracy: Accuracy, before: Accuracy | None = None, facts: dict | None = None) -> GuardStep:
    added = [b.added_error for b in blamed if math.isfinite(b.added_error)]
    return GuardStep(
        nodes=[b.node for b in blamed],
        ops=[b.op for b in blamed],
        reason="; ".join(sorted({b.reason() for b in blamed})) or None,
        added_error=round(max(added), 6) if added else None,
        cosine=round(accuracy.worst_cosine, 6),
        max_abs=_max_abs(accuracy),
        within_tolerance=accuracy.within_tolerance,
        bought_cosine=None if before is None else round(accuracy.worst_cosine - before.worst_cosine, 6),
        facts=facts or {},
    )
