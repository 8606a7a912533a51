"""Evaluate a stage: accuracy against the reference on the evaluation set, latency per batch size.

Two phases, each cached on its own: `evaluate_*` (accuracy and the batch_sizes latencies, every
stage) and `sweep_*` (the latency curves of `evaluate.sweep`, which the caller asks for only for
the stages that need them: by default the Pareto frontier's).

Results are cached by (model hash, reference, data, settings, machine): a rerun of
an unchanged recipe measures nothing again. The report marks them cached.
"""
from __future__ import annotations

import logging
from functools import cached_property
from typing import Callable

from optpipe.evaluation.accuracy import compare, run_callable, run_onnx
from optpipe.core.artifact import ModelArtifact
from optpipe.cache.store import StageCache, library_versions
from optpipe.evaluation import openvino_runtime
from optpipe.core.errors import NonFiniteOutputs
from optpipe.evaluation.self_check import SelfCheckParams, export_mismatch, require_finite
from optpipe.calibration.dataset import SampleSet
from optpipe.evaluation.latency import Warmth, measure, warm_for
from optpipe.evaluation.held_eager import HeldEager
from optpipe.evaluation.memory import PeakMemory
from optpipe.hardware.cpu_features import engine_target, machine_id
from optpipe.core.process_memory import release_freed_memory
from optpipe.core.results import Accuracy, Latency, Memory
from optpipe.evaluation.cached_figures import decode_figures, encode_figures
from optpipe.recipe.schema import EvaluateSpec, ModelInputs, Tolerance
from optpipe.core.runtime import Feeds, Outputs, as_exported, eager_runner, resize_dim, ort_runner, ort_session, pick_providers, requested_providers

EVAL_FORMAT = 11  # 3: adaptive iteration counts, eager beside each stage, busy flags; 4: task metrics, input sensitivity, rtol;
# 5: sweeps cached apart from the headline; 6: integer outputs held by equality, busy from other processes' CPU; 7: a time budget
# per figure, its interval and why timing stopped; 8: a reference ~0 (< fp16's range) warned; 9: no cosine verdict on integers;
# 10: eager's outputs as exported (runtime.as_exported), cosine over the real tokens of any padding mask (cosine.real_tokens);
# 11: R² holds an output where a constant one meets the cosine bound (evaluation.variation)
#: Settings that shape only the sweep curves: not part of the headline's cache key.
SWEEP_SETTINGS = {"sweep", "sweep_iterations", "sweep_stages"}
#: Settings that shape no figure (a search's strategy or budget, the Ray resources, the eager baseline
#: on or off; the reference is keyed on its own; eager_timing: keyed as resolved, `_result_key`).
UNMEASURED_SETTINGS = {"search", "resources", "providers", "eager_baseline", "reference", "eager_timing"}  # providers: resolved in the key

# Measured here on a loaded 2-core machine (load 17): a fresh PyTorch eager model's calls took 50-250 ms
# for its first 2-4 s (its new intra-op threads waiting for the scheduler), then 0.05 ms; timed in that
# window, every stage looked "3000x faster than eager". Eager is warmed for this long once per run.
EAGER_WARM_S = 3.0

Progress = Callable[[str, int, int], None]
Measured = tuple[Accuracy | None, list[Latency], Memory | None, bool]  # accuracy, latency, peak memory, cached
Swept = tuple[list[Latency], bool]  # the sweep points, cached


def no_progress(task: str, done: int, total: int) -> None:
    pass


class Evaluator:
    def __init__(self, settings: EvaluateSpec, shapes: ModelInputs, cache: StageCache, eval_set: Callable[[], SampleSet],
                 providers: str = "auto", progress: Progress = no_progress, force: bool = False, eager_timing: str = "interleaved"):
        """`eager_timing`: evaluate.eager_timing resolved (plan/source_preflight.eager_timing): interleaved or apart."""
        self.shapes = shapes  # the inputs and dims: batch dim, sweep values, a sample's axes
        self.force = force  # --force: measure again, replacing the cached results
        self.progress = progress
        self.cache = cache
        self._eval_set = eval_set
        self.settings = settings
        self.providers = pick_providers(requested_providers(settings.providers, providers))
        self._reference: tuple[str, str, Callable[[], Outputs]] | None = None
        self._export_check: SelfCheckParams | None = None
        self._eager: HeldEager[Callable[[Feeds], Outputs]] = HeldEager(eager_timing)
        self._eager_failed = False
        # What this run warmed on which shapes: eager, timed again beside every stage, is warmed once.
        self._warmth = Warmth()

    @cached_property
    def eval_set(self) -> SampleSet:
        return self._eval_set()

    @cached_property
    def accuracy_batches(self) -> list[Feeds]:
        size = self.settings.accuracy_batch if self.shapes.batch_dim() else self._fixed_batch()
        return list(self.eval_set.batches(size))

    @cached_property
    def all_inputs(self) -> Feeds:
        return self.eval_set.arrays

    def set_reference(self, name: str, digest: str, outputs: Callable[[], Outputs]) -> None:
        """The stage every other is compared against; its outputs are computed only when needed."""
        cache: dict[str, Outputs] = {}

        def lazy(compute: Callable[[], Outputs] = outputs) -> Outputs:
            if "out" not in cache:
                cache["out"] = compute()
            return cache["out"]

        self._reference = (name, digest, lazy)

    def set_export_check(self, params: SelfCheckParams) -> None:
        """The reference is the export: eager's row also holds it to the export's own self-check on the evaluation data."""
        self._export_check = params

    def onnx_outputs(self, artifact: ModelArtifact) -> Outputs:
        return run_onnx(artifact.path, self.accuracy_batches, self.settings.threads, self.providers,
                        progress=lambda done, total: self.progress("the reference stage's outputs, batch", done, total))

    def _accuracy_progress(self, done: int, total: int) -> None:
        self.progress("accuracy batch", done, total)

    def evaluate_onnx(self, artifact: ModelArtifact, tolerance: Tolerance) -> Measured:
        if openvino_runtime.is_ir(artifact.folder):  # an `openvino` stage: OpenVINO's runtime, same protocol
            return self.evaluate_openvino(artifact, tolerance)

        def start() -> tuple[Callable[[Feeds], Outputs], Callable[[], Outputs]]:
            session = ort_session(artifact.path, self.settings.threads, self.providers)
            # The same session computes the accuracy outputs: one session per stage, and the reference
            # stage's outputs computed once (the outputs memo).
            return ort_runner(session), lambda: run_onnx(artifact.path, self.accuracy_batches, self.settings.threads,
                                                         session=session, progress=self._accuracy_progress)

        return self._measure_stage(self._result_key(artifact.content_hash(), tolerance), artifact.content_hash(), tolerance,
                                   "ONNX Runtime session", self.providers[0], start,
                                   device=self.providers[0] != "CPUExecutionProvider")

    def sweep_onnx(self, artifact: ModelArtifact, headline: list[Latency]) -> Swept:
        """The sweep points of a stage (ORT, or OpenVINO for an IR stage); `headline`: its batch_sizes
        figures, reused for a sweep point on the very same inputs instead of timing it again."""
        if openvino_runtime.is_ir(artifact.folder):
            path, hint, names = openvino_runtime.stage_settings(artifact)
            extra = {"runtime": "openvino", "hint": hint, **library_versions(("openvino", "nncf"))}
            build = lambda: openvino_runtime.runner(openvino_runtime.compile_model(path, self.settings.threads, hint), names)  # noqa: E731
            return self._cached_sweep(self._sweep_key(artifact.content_hash(), extra), build, openvino_runtime.PROVIDER, headline)
        build = lambda: ort_runner(ort_session(artifact.path, self.settings.threads, self.providers))  # noqa: E731
        return self._cached_sweep(self._sweep_key(artifact.content_hash()), build, self.providers[0], headline)

    def sweep_eager(self, source_digest: str, headline: list[Latency]) -> Swept:
        """PyTorch eager's sweep points (after `evaluate_eager`): the curves' baseline."""
        key = self._sweep_key("eager:" + source_digest, library_versions(("torch",)))
        try:
            return self._cached_sweep(key, lambda: self._eager_baseline() or _raise_no_eager(), "pytorch-cpu", headline)
        finally:
            self._eager.drop_apart()

    def _cached_sweep(self, key: str, build: Callable[[], Callable[[Feeds], Outputs]], provider: str,
                      headline: list[Latency]) -> Swept:
        if not self.settings.sweep:
            return [], True
        with self.cache.lock(key):
            hit = None if self.force else self.cache.get_result(key)
            if hit is not None:
                return [Latency.model_validate(lat) for lat in hit["latency"]], True
            self.progress("build the runtime for the curves", 0, 0)
            points = self._sweep_latency(build(), provider, headline)
            self.cache.put_result(key, {"latency": [lat.model_dump(mode="json") for lat in points]})
        return points, False

    def evaluate_openvino(self, artifact: ModelArtifact, tolerance: Tolerance) -> Measured:
        """An IR stage (or any ONNX/IR file OpenVINO reads) measured like the ORT rows: same inputs,
        reference, threads and latency protocol; labelled `openvino-cpu` in the latency rows."""
        path, hint, names = openvino_runtime.stage_settings(artifact)
        # eager_beside: results timed before eager was interleaved with IR stages are not reused.
        key = self._result_key(artifact.content_hash(), tolerance, extra={"runtime": "openvino", "hint": hint, "eager_beside": 1,
                               **library_versions(("openvino", "nncf"))})

        def start() -> tuple[Callable[[Feeds], Outputs], Callable[[], Outputs]]:
            run = openvino_runtime.runner(openvino_runtime.compile_model(path, self.settings.threads, hint), names)
            return run, lambda: run_callable(run, self.accuracy_batches, self._accuracy_progress)

        return self._measure_stage(key, artifact.content_hash(), tolerance, "OpenVINO compile_model",
                                   openvino_runtime.PROVIDER, start)

    def _measure_stage(self, key: str, digest: str, tolerance: Tolerance, what: str, provider: str,
                       start: Callable[[], tuple[Callable[[Feeds], Outputs], Callable[[], Outputs]]],
                       device: bool = False) -> Measured:
        """One stage's evaluation, whatever runs it (ORT or OpenVINO: one protocol, so that the two cannot
        drift apart, as they once did on the interleaved eager figure and on --force).

        `start()` builds the runtime: its runner for the timed calls, and a function for its accuracy outputs.
        """
        # Under the key's lock: a second process on the same cache waits and reuses the measurement
        # rather than measuring at the same time (and slowing both down).
        with self.cache.lock(key):
            hit = None if self.force else self.cache.get_result(key)
            if hit is not None:
                return decode_figures(hit) + (True,)
            # Eager is re-timed interleaved beside every stage: the report's 'vs eager' says so (an IR stage
            # once timed alone against eager's figure from minutes before: MiniLM ov-int8 3.0x that way where
            # the interleaved bench gave 3.8x, one x86-avx512-vnni VM). Apart, right after the stage instead.
            baseline = None if self._eager.apart else self._eager_baseline()
            # Peak memory covers what the runtime itself costs: its creation and the timed runs.
            with PeakMemory(device=device) as peak:
                self.progress(what, 0, 0)
                run, outputs = start()
                latency = self._latency(run, provider, baseline)
            accuracy = self._accuracy(outputs, tolerance, digest)  # outside the memory figure, as before
            del run, outputs  # the session goes before the next stage builds its own
            if self._eager.apart:
                latency = self._eager_after(latency)
            self.cache.put_result(key, encode_figures(accuracy, latency, peak.result()))
        return accuracy, latency, peak.result(), False

    def evaluate_eager(self, torch_model, source_digest: str, tolerance: Tolerance, release: Callable[[], object] = lambda: None) -> Measured:
        """`release`: drops the run's torch model (RunServices.release_torch_model), called apart once eager is timed."""
        check = self._export_check
        extra = {**library_versions(("torch",)), **({"export_check": [check.check_atol, check.check_rtol]} if check else {})}
        key = self._result_key("eager:" + source_digest, tolerance, extra=extra)
        with self.cache.lock(key):
            # Stages timed after this one re-time eager beside themselves (or after themselves): keep a way to build it.
            self._eager.set_source(lambda: self._warmed(eager_runner(torch_model(), self.settings.threads)), release)
            hit = None if self.force else self.cache.get_result(key)
            if hit is not None:
                return decode_figures(hit) + (True,)
            # Built again when the shared one failed, so that its real error reaches the eager row.
            run = self._eager_baseline() or eager_runner(torch_model(), self.settings.threads)
            with as_exported():  # the exporters' semantics; timed below with PyTorch's fast paths, as its users run it
                outputs = run_callable(run, self.accuracy_batches, self._accuracy_progress) if self._reference else {}
            accuracy = self._accuracy(lambda: outputs, tolerance)
            if accuracy is not None and check is not None:
                accuracy.export_mismatch = export_mismatch(self._reference[2](), outputs, self.all_inputs, check)
            outputs = {}  # a decoder's logits can be a GB: not held while eager is timed
            with PeakMemory() as peak:
                latency = self._latency(run, "pytorch-cpu")
            del run
            self._eager.drop_apart()
            self.cache.put_result(key, encode_figures(accuracy, latency, peak.result()))
        return accuracy, latency, peak.result(), False

    def _accuracy(self, outputs: Callable[[], Outputs], tolerance: Tolerance, digest: str | None = None) -> Accuracy | None:
        """`digest`: the candidate's model hash; the reference stage itself computes its outputs once."""
        if self._reference is None:
            return None
        name, ref_digest, reference = self._reference
        if digest == ref_digest:
            candidate = reference(outputs)  # the same model: its outputs are the reference's
        else:
            candidate = outputs()
        expected = reference()  # its ±inf are what the model means (masked logits); a candidate's must match them
        candidate = require_finite(candidate, "it outputs", NonFiniteOutputs, self.all_inputs, like=expected)
        expected = require_finite(expected, f"the reference stage '{name}' outputs", NonFiniteOutputs, self.all_inputs, like=expected)
        return compare(candidate, expected, self.all_inputs, tolerance, name, self.settings.top1,
                       task=self.settings.task, labels=self.eval_set.labels,
                       min_input_sensitivity=self.settings.min_input_sensitivity)

    def _eager_baseline(self) -> Callable[[Feeds], Outputs] | None:
        """PyTorch eager (HeldEager: once for the run when interleaved, again after each stage apart), or None
        where it fails: the eager row reports its own failure, and the stages are timed alone then."""
        if self._eager_failed or not self._eager.has_source:
            return None
        try:
            return self._eager.get()
        except Exception:  # noqa: BLE001
            self._eager_failed = True  # one try: a failing eager fails once
            logging.getLogger("optpipe").debug("PyTorch eager unavailable as a baseline", exc_info=True)
            return None

    def _warmed(self, run: Callable[[Feeds], Outputs]) -> Callable[[Feeds], Outputs]:
        """A new eager runner, warmed up (so its allocations precede any stage's peak memory)."""
        self.progress("PyTorch eager: load the model", 0, 0)
        feeds = self.eval_set.first(self._batch_sizes()[0])
        warm_for(run, feeds, EAGER_WARM_S,
                 progress=lambda calls, _: self.progress(f"PyTorch eager: {EAGER_WARM_S:g} s of warm-up calls", calls, 0))
        self._warmth.record(run, feeds)  # its untimed calls are done; a timed run still settles it
        return run

    def _eager_after(self, latency: list[Latency]) -> list[Latency]:
        """Apart: eager loaded again once the stage's runtime is gone, and its headline batch timed alone right
        after the stage's; the stage's headline figure takes it as its eager figure, labelled eager_apart."""
        if not latency:
            return latency
        release_freed_memory()  # the stage's freed session pages, before eager's weights come back
        run = self._eager_baseline()
        if run is None:
            return latency
        try:
            batch = self._batch_sizes()[0]
            eager = self._measure(run, self.eval_set.first(batch), self.settings.iterations, "pytorch-cpu",
                                  f"PyTorch eager after the stage: latency batch {batch}")
        finally:
            del run
            self._eager.drop_apart()
        busy = [r for r in (latency[0].unreliable, eager.unreliable and f"eager after it: {eager.unreliable}") if r]
        head = latency[0].model_copy(update={"eager_p50_ms": eager.p50_ms, "eager_p90_ms": eager.p90_ms, "eager_apart": True,
                                             "unreliable": "; ".join(busy) or None})
        return [head, *latency[1:]]

    def _latency(self, run: Callable[[Feeds], Outputs], provider: str, baseline=None) -> list[Latency]:
        """The batch_sizes measurements (the report's headline); the sweeps are `sweep_*`'s.

        The headline batch is timed interleaved with `baseline` (PyTorch eager) when given: its
        speed-up then compares two figures taken over the same minutes.
        """
        s = self.settings
        results = []
        for i, batch in enumerate(self._batch_sizes()):
            beside = baseline if i == 0 else None
            results.append(self._measure(run, self.eval_set.first(batch), s.iterations, provider, f"latency batch {batch}", beside))
        return results

    def _sweep_latency(self, run: Callable[[Feeds], Outputs], provider: str, headline: list[Latency]) -> list[Latency]:
        """One point per sweep value. A point on the very inputs a headline figure was timed on (the
        batch sweep at batch_sizes[0], the sequence sweep at the evaluated length) is that figure,
        labelled as the sweep's: timing it again would measure the same thing with fewer runs."""
        s = self.settings
        timed = {_shape_key(lat.shape): lat for lat in headline if lat.sweep is None}
        results = []
        for dim, value, feeds in self._sweep_points():
            point = timed.get(_shape_key({name: list(array.shape) for name, array in feeds.items()}))
            if point is not None:
                point = point.model_copy(update={"eager_p50_ms": None, "eager_p90_ms": None})
            else:
                point = self._measure(run, feeds, s.sweep_iterations or s.iterations, provider, f"{dim} sweep {_dims_text(feeds)}")
            results.append(point.model_copy(update={"sweep": dim, "sweep_value": value}))
        return results

    def _measure(self, run, feeds: Feeds, iterations: int, provider: str, task: str, baseline=None) -> Latency:
        report = lambda done, total: self.progress(task, done, total)  # noqa: E731
        warming = lambda calls: self.progress(f"{task}: warm-up call", calls, 0)  # noqa: E731
        self.progress(f"{task}: warm-up", 0, 0)
        latency = measure(run, feeds, self.settings.warmup, iterations, self.settings.threads, provider, progress=report,
                          baseline=baseline, adaptive=self.settings.adaptive, warmth=self._warmth, warming=warming,
                          budget_s=self.settings.figure_budget_s)
        # Every figure names the CPU class it was timed on: OpenVINO's own where ONEDNN_MAX_CPU_ISA holds it lower.
        engine = "openvino" if provider == openvino_runtime.PROVIDER else "onnxruntime"
        return latency.model_copy(update={"cpu_class": engine_target(engine).cpu_class})

    def _sweep_points(self) -> list[tuple[str, int, Feeds]]:
        """Inputs for each sweep value: evaluation samples, the swept dim resized, the others as evaluated."""
        batch_dim = self.shapes.batch_dim()
        points = []
        for dim in self.settings.sweep:
            for value in self.shapes.sweep_values(dim, self.settings.sweep[dim]):
                batch = value if dim == batch_dim else self._batch_sizes()[0]
                feeds = self.eval_set.first(batch)
                if dim != batch_dim:
                    feeds = {name: resize_dim(array, self._axes_of(name, dim), value) for name, array in feeds.items()}
                points.append((dim, value, feeds))
        return points

    def _axes_of(self, input_name: str, dim: str) -> list[int]:
        spec = next((s for s in self.shapes.inputs if s.name == input_name), None)
        return [axis for axis, d in enumerate(spec.shape) if d == dim] if spec else []

    def _batch_sizes(self) -> list[int]:
        return self.settings.batch_sizes if self.shapes.batch_dim() else [self._fixed_batch()]

    def _fixed_batch(self) -> int:
        first = self.shapes.inputs[0].shape[0] if self.shapes.inputs[0].shape else 1
        return first if isinstance(first, int) else 1

    def _sweep_key(self, model_digest: str, extra: dict | None = None) -> str:
        """A stage's sweep points depend on its model, the data, the timing settings and the machine."""
        return StageCache.key(
            format=EVAL_FORMAT,
            part="sweep",
            model=model_digest,
            data=self.eval_set.key,
            settings=self.settings.model_dump(mode="json", exclude=UNMEASURED_SETTINGS | {"sweep_stages", "tolerance"}),
            providers=self.providers,
            machine=machine_id(),
            libraries=library_versions(("onnxruntime", "onnxruntime-gpu")),
            extra=extra,
        )

    def _result_key(self, model_digest: str, tolerance: Tolerance, extra: dict | None = None) -> str:
        reference = self._reference[:2] if self._reference else None
        return StageCache.key(
            format=EVAL_FORMAT,
            model=model_digest,
            reference=reference,
            data=self.eval_set.key,
            # What shapes these figures only: the reference is keyed above; the sweeps are cached apart.
            settings=self.settings.model_dump(mode="json", exclude=UNMEASURED_SETTINGS | SWEEP_SETTINGS),
            tolerance=tolerance.model_dump(mode="json"),
            providers=self.providers,
            machine=machine_id(),
            libraries=library_versions(("onnxruntime", "onnxruntime-gpu")),
            extra=extra,
            # Resolved (plan/source_preflight.eager_timing); named only when apart, so that the interleaved results
            # measured before the setting existed keep their keys.
            **({"eager_timing": "apart"} if self._eager.apart else {}),
        )


def _shape_key(shape: dict[str, list[int]]) -> tuple:
    return tuple(sorted((name, tuple(dims)) for name, dims in shape.items()))


def _raise_no_eager():
    raise RuntimeError("PyTorch eager is not available as a baseline")


def _dims_text(feeds: Feeds) -> str:
    return "x".join(str(d) for d in next(iter(feeds.values())).shape)
