"""Stage evaluation for a decoder with a KV cache (evaluate.generation): every stage, and PyTorch
eager with its own cache, measured by greedy generation (evaluation/generation.py's loop) instead
of one forward over a fixed sequence.

Per stage: time to first token and decode tokens/s at batch 1 and the recipe's batch sizes, each
stage's rounds interleaved with eager's (speed ratios from the same minutes); next-token agreement
with the reference (eager, or the reference stage for an ONNX source) over the reference's greedy
tokens, teacher-forced; perplexity on the recipe's text; peak RSS. The stage's `latency` rows are
its decode steps (ms per step of the whole batch), so the frontier's latency axis is decode speed;
its accuracy error is 1 - the agreement (Accuracy.error via the task's headline), not cosine.

Results are cached like the other evaluations: keyed by the model's hash, the reference, the
generation and task settings, the perplexity text's content, threads, the machine and the runtimes' versions.
"""
from __future__ import annotations

import functools
import os
import statistics
from pathlib import Path
from typing import Callable

import numpy as np

from optpipe.cache.store import StageCache, library_versions
from optpipe.core.artifact import sha256_file
from optpipe.core.process_memory import release_freed_memory
from optpipe.core.results import EAGER, Accuracy, Generation, GenerationRow, Latency, Memory, OutputAccuracy, TaskAccuracy
from optpipe.evaluation import generation as gen
from optpipe.evaluation import generation_inputs as inputs
from optpipe.evaluation import cpu_contention, openvino_runtime
from optpipe.evaluation.figure_warnings import magnitude_warnings, tied_logits_warnings
from optpipe.evaluation.cosine import row_cosines
from optpipe.evaluation.held_eager import HeldEager
from optpipe.evaluation.latency import busy_reason
from optpipe.evaluation.memory import PeakMemory
from optpipe.hardware.cpu_features import engine_target, machine_id
from optpipe.recipe.schema import EvaluateSpec, ModelSource, TaskSpec, Tolerance
from optpipe.recipe.task_bounds import own_bounds

FORMAT = 3  # 3: the reference's ~0 or tied logits warned; 2: busy flags (tail, rounds spread, other processes) on the decode-step rows
RANDOM_WEIGHTS = ("model.hf_config builds random weights: these accuracy figures mean nothing (a random decoder's logits "
                  "are near ties, so agreement and perplexity say nothing about quality); point `model` at an hf folder "
                  "with real weights for them")


class GenerationEvaluator:
    """evaluate_eager as evaluation/evaluator.Evaluator's; evaluate_stage(name, ...) for its evaluate_onnx."""

    def __init__(self, evaluate: EvaluateSpec, source: ModelSource, cache: StageCache, progress=None, force: bool = False,
                 eager_timing: str = "interleaved"):
        """`eager_timing`: evaluate.eager_timing resolved: interleaved (eager held beside every stage, rounds
        alternating) or apart (eager's model loaded again after each stage's runtime is closed, timed right after)."""
        self.evaluate, self.spec, self.source, self.cache = evaluate, evaluate.generation, source, cache
        self.progress = progress or (lambda task, done, total: None)
        self.force = force
        self.figures: dict[str, Generation] = {}
        self._eager: HeldEager[gen.EagerRunner] = HeldEager(eager_timing)
        self._eager_layout = None
        self._reference: tuple[str, Callable[[], tuple]] | None = None  # (name, () -> (runner, layout))
        self._ref_figures: dict | None = None

    # --- the two entry points stage_evaluation calls ------------------------------------------------

    def evaluate_eager(self, torch_model, source_digest: str, tolerance: Tolerance, release: Callable[[], object] = lambda: None):
        """`release`: drops the run's torch model (RunServices.release_torch_model); apart, once eager is timed."""
        from optpipe.source.decoder_export import hf_causal_lm, layout_of
        from optpipe.recipe.generation_spec import decoder_dims

        def runner():
            model = hf_causal_lm(torch_model())
            dims = decoder_dims(self.spec, self.source.inputs, self.source.dims, self.evaluate.task.tokens)
            self._eager_layout = layout_of(model, *dims)
            return gen.EagerRunner(model, self._eager_layout, self.evaluate.threads, name=EAGER)

        def build():
            return self._eager.get(), self._eager_layout

        self._eager.set_source(runner, release)
        self._reference = (EAGER, build)
        key = self._key("eager:" + source_digest, {"runtime": "torch", **library_versions(("torch", "transformers"))})
        try:
            return self._cached(key, "eager", lambda: self._measure_eager(build))
        finally:
            self._eager.drop_apart()

    def set_reference_stage(self, name: str, artifact) -> None:
        """The yardstick where eager is not measured (an ONNX source, eager_baseline: false): the reference stage."""
        self._reference = (name, lambda: self._runner(name, artifact)[0]())

    def evaluate_stage(self, name: str, artifact, tolerance: Tolerance):
        build, runtime = self._runner(name, artifact)
        task = self.evaluate.task.bounded(tolerance.task)
        # Apart is named in the key (eager's figures in the rows were timed after the stage); interleaved keys as before.
        key = self._key(artifact.content_hash(), {**runtime, **({"eager_timing": "apart"} if self._eager.apart else {})}, task)
        return self._cached(key, artifact.content_hash(),
                            lambda: self._measure_stage(build, runtime["runtime"] == "openvino", task, own_bounds(tolerance.task)))

    def _runner(self, name: str, artifact):
        """(() -> (runner, layout), the runtime's part of the cache key) for a stage's model."""
        ir = openvino_runtime.is_ir(artifact.folder)
        path, hint, _ = openvino_runtime.stage_settings(artifact)
        layout = inputs.layout_of_stage(path, ir, self.evaluate, self.source, name)
        runtime = {"runtime": "openvino", "hint": hint, **library_versions(("openvino",))} if ir else \
            {"runtime": "onnxruntime", **library_versions(("onnxruntime",))}

        def build():
            return (gen.OpenVinoRunner(path, layout, self.evaluate.threads, hint, name=name) if ir else
                    gen.OrtRunner(path, layout, self.evaluate.threads, name=name)), layout

        return build, runtime

    def generation_of(self, digest: str | None) -> Generation | None:
        return self.figures.get(digest or "")

    # --- measuring -----------------------------------------------------------------------------------

    def _cached(self, key: str, figures_key: str, measure):
        with self.cache.lock(key):
            hit = None if self.force else self.cache.get_result(key)
            if hit is None:
                accuracy, latency, memory, figures = measure()
                self.cache.put_result(key, {"accuracy": accuracy.model_dump(mode="json") if accuracy else None,
                                            "latency": [lat.model_dump(mode="json") for lat in latency],
                                            "memory": memory.model_dump(mode="json"), "generation": figures.model_dump(mode="json")})
                self.figures[figures_key] = figures
                return accuracy, latency, memory, False
        self.figures[figures_key] = Generation.model_validate(hit["generation"])
        accuracy = Accuracy.model_validate(hit["accuracy"]) if hit["accuracy"] else None
        return accuracy, [Latency.model_validate(x) for x in hit["latency"]], Memory.model_validate(hit["memory"]), True

    def _measure_eager(self, build):
        with PeakMemory() as peak:
            runner, layout = build()
            rows, latency = self._speed(runner, layout, None, "pytorch-cpu")
            ref = self._reference_figures()
        figures = self._figures(layout, rows, None, ref["perplexity"], peak.result())
        return None, latency, peak.result(), figures

    def _measure_stage(self, build, ir: bool, task: TaskSpec, bounds: dict[str, float]):
        ref = self._reference_figures()
        reference_name, reference_build = self._reference
        beside = reference_build()[0] if reference_name == EAGER and not self._eager.apart else None
        self._eager.drop_apart()  # the reference's figures may have loaded it: gone before the stage's runtime comes
        with PeakMemory() as peak:
            runner, layout = build()
            rows, latency = self._speed(runner, layout, beside, openvino_runtime.PROVIDER if ir else "CPUExecutionProvider")
            agreement = float(np.mean([gen.forced_agreement(runner, layout, p[None], t) for p, t in zip(ref["prompts"], ref["tokens"])]))
            prefill = [runner.forward(p[None], np.ones((1, len(p)), np.int64), gen.empty_past(layout, 1))[0] for p in ref["prompts"]]
            perplexity = gen.perplexity(runner, layout, ref["text"])
            runner.close()
        if reference_name == EAGER and self._eager.apart:
            rows, latency = self._eager_after(rows, latency)
        accuracy = self._accuracy(agreement, perplexity, ref, prefill, task)
        accuracy.task.own_bounds = bounds
        return accuracy, latency, peak.result(), self._figures(layout, rows, agreement, perplexity, peak.result(), ref["perplexity"])

    def _eager_after(self, rows: list[GenerationRow], latency: list[Latency]) -> tuple[list[GenerationRow], list[Latency]]:
        """Apart: eager loaded again once the stage's runtime is closed, its rounds timed alone right after the
        stage's on the same prompts; each row takes them as its eager figures, labelled eager_apart."""
        release_freed_memory()  # the stage's freed pages, before eager's weights come back
        runner, layout = self._reference[1]()
        try:
            eager_rows, eager_latency = self._speed(runner, layout, None, "pytorch-cpu", "PyTorch eager after the stage: ")
        finally:
            del runner
            self._eager.drop_apart()
        rows = [row.model_copy(update={"eager_ttft_ms": e.ttft_ms, "eager_decode_tokens_per_s": e.decode_tokens_per_s})
                for row, e in zip(rows, eager_rows)]
        latency = [lat.model_copy(update={
            "eager_p50_ms": e.p50_ms, "eager_p90_ms": e.p90_ms, "eager_apart": True,
            "unreliable": "; ".join(r for r in (lat.unreliable, e.unreliable and f"eager after it: {e.unreliable}") if r) or None})
            for lat, e in zip(latency, eager_latency)]
        return rows, latency

    def _reference_figures(self) -> dict:
        """The reference's greedy tokens after each batch-1 prompt, its prefill logits and perplexity, once per run."""
        if self._ref_figures is None:
            runner, layout = self._reference[1]()
            texts = inputs.texts(self.spec, self.source, layout.vocab, layout.max_sequence)
            tokens = [gen.greedy(runner, layout, p[None], self.spec.new_tokens).tokens for p in texts.prompts]
            logits = [runner.forward(p[None], np.ones((1, len(p)), np.int64), gen.empty_past(layout, 1))[0] for p in texts.prompts]
            rows = np.concatenate([x[0] for x in logits])  # [prompt positions, vocabulary]
            self._ref_figures = {"prompts": texts.prompts, "tokens": tokens, "logits": logits, "text": texts.text,
                                 "how": texts.tokens, "perplexity": gen.perplexity(runner, layout, texts.text),
                                 # the reference's own: the same for every stage measured against it
                                 "warnings": magnitude_warnings([("logits", rows, rows)]) or tied_logits_warnings(rows)}
            if self._reference[0] != EAGER:
                runner.close()  # a reference stage's session: its figures are kept, its weights need not be
        return self._ref_figures

    def _speed(self, runner, layout, beside, provider: str, label: str = "") -> tuple[list[GenerationRow], list[Latency]]:
        """Each batch size: a warm-up generation each, then `rounds` generations alternating with `beside`'s."""
        prompts = self._reference_figures()["prompts"]
        rows, latency = [], []
        for batch in self.spec.all_batch_sizes():
            prompt = inputs.batch_prompt(prompts, batch)
            pair = [runner] + ([beside] if beside is not None else [])
            for r in pair:
                gen.greedy(r, layout, prompt, 2)
            runs: dict[str, list[gen.Generation]] = {r.name: [] for r in pair}
            before = cpu_contention.snapshot()
            for index in range(self.spec.rounds):
                for r in pair:
                    runs[r.name].append(gen.greedy(r, layout, prompt, self.spec.new_tokens))
                self.progress(f"{label}generation batch {batch}", index + 1, self.spec.rounds)
            own, eager = runs[runner.name], runs.get(beside.name) if beside is not None else None
            rows.append(GenerationRow(batch_size=batch, ttft_ms=_median_ms(g.ttft_s for g in own),
                                      decode_tokens_per_s=statistics.median(g.decode_tokens_per_s for g in own),
                                      eager_ttft_ms=_median_ms(g.ttft_s for g in eager) if eager else None,
                                      eager_decode_tokens_per_s=statistics.median(g.decode_tokens_per_s for g in eager) if eager else None))
            others = cpu_contention.shares(before, cpu_contention.snapshot())
            latency.append(self._latency(batch, own, eager, provider, others))
        return rows, latency

    def _latency(self, batch: int, own: list, eager: list | None, provider: str,
                 others: tuple[float | None, float | None]) -> Latency:
        """One decode step (ms) per round; busy as latency.py judges it (tail, rounds' spread, other processes' CPU,
        the container's quota: `others`, as cpu_contention reads them)."""
        steps = [g.decode_s / max(g.tokens.shape[1] - 1, 1) * 1e3 for g in own]
        p50 = statistics.median(steps)
        eager_steps = [g.decode_s / max(g.tokens.shape[1] - 1, 1) * 1e3 for g in eager] if eager else None
        engine = "openvino" if provider == openvino_runtime.PROVIDER else "onnxruntime"
        busy = [r for r in (busy_reason(np.array(steps), steps, *others),
                            eager_steps and busy_reason(np.array(eager_steps), eager_steps, None)) if r]
        return Latency(batch_size=batch, shape={"input_ids": [batch, 1]}, p50_ms=p50, p90_ms=float(np.percentile(steps, 90)),
                       p99_ms=max(steps), mean_ms=statistics.fmean(steps), throughput=batch * 1e3 / p50, iterations=len(steps),
                       provider=provider, load_average=os.getloadavg()[0], others_cpu=others[0], throttled=others[1],
                       unreliable="; ".join(busy) or None, spread=(max(steps) - min(steps)) / p50 if p50 else None,
                       eager_p50_ms=statistics.median(eager_steps) if eager_steps else None,
                       eager_p90_ms=float(np.percentile(eager_steps, 90)) if eager_steps else None,
                       cpu_class=engine_target(engine).cpu_class)

    def _accuracy(self, agreement: float, perplexity: float, ref: dict, prefill: list[np.ndarray], task_spec: TaskSpec) -> Accuracy:
        ratio = perplexity / ref["perplexity"]
        task = TaskAccuracy(kind="language-model", output="logits", metrics={
            "next_token_agreement": agreement, "perplexity": perplexity, "reference_perplexity": ref["perplexity"],
            "perplexity_ratio": ratio})
        task.notes.append(f"greedy generation: {self.spec.new_tokens} tokens after each of {len(ref['prompts'])} prompts, "
                          f"teacher-forced against {self._reference[0]}; perplexity over {ref['text'].shape[1]} tokens ({ref['how']})")
        if agreement < task_spec.agreement_min:
            task.violations.append(f"next-token agreement {agreement:.3f} with {self._reference[0]} over the generated tokens "
                                   f"< {task_spec.agreement_min}")
        if ratio > task_spec.perplexity_ratio_max:
            task.violations.append(f"perplexity {perplexity:.3f} is {ratio:.3f}x {self._reference[0]}'s {ref['perplexity']:.3f} "
                                   f"(allowed {task_spec.perplexity_ratio_max}x)")
        cand = np.concatenate([x[0] for x in prefill]).astype(np.float64)
        expected = np.concatenate([x[0] for x in ref["logits"]]).astype(np.float64)
        cosines = row_cosines(cand, expected)
        logits = OutputAccuracy(name="logits", max_abs=float(np.abs(cand - expected).max()), mean_abs=float(np.abs(cand - expected).mean()),
                                cosine_mean=float(cosines.mean()), cosine_min=float(cosines.min()),
                                top1=float((cand.argmax(-1) == expected.argmax(-1)).mean()))
        warnings = [RANDOM_WEIGHTS] if inputs.weights_kind(self.source) == "random" else []
        warnings += ref["warnings"]
        return Accuracy(reference=self._reference[0], samples=len(ref["prompts"]), outputs=[logits],
                        within_tolerance=not task.violations, violations=list(task.violations), task=task, warnings=warnings)

    def _figures(self, layout, rows, agreement, perplexity, memory: Memory, ref_perplexity: float | None = None) -> Generation:
        ref = self._reference_figures()
        return Generation(weights=inputs.weights_kind(self.source), tokens=ref["how"], prompts=len(ref["prompts"]),
                          new_tokens=self.spec.new_tokens, prompt_tokens=min(len(p) for p in ref["prompts"]), rows=rows,
                          next_token_agreement=agreement, perplexity=perplexity,
                          eager_perplexity=ref_perplexity if self._reference[0] == EAGER else None,
                          text_tokens=int(ref["text"].shape[1]), peak_rss_bytes=memory.host_rss_bytes)

    def _key(self, model_digest: str, extra: dict, task: TaskSpec | None = None) -> str:
        reference = self._reference[0] if self._reference else None
        return StageCache.key(format=FORMAT, part="generation", model=model_digest, reference=reference,
                              generation=self.spec.model_dump(mode="json"), text=self._text_digest,
                              task=(task or self.evaluate.task).model_dump(mode="json"),
                              threads=self.evaluate.threads, source=_source_key(self.source), machine=machine_id(), extra=extra)

    @functools.cached_property
    def _text_digest(self) -> str | None:
        """The perplexity text's bytes, hashed: the recipe names the file by its path, and a file edited in place
        (recipes/gemma3-270m.yaml reads the README) must not hand back the perplexity of its old words. None where
        it cannot be read: the measurement then names the file in its own one-line error."""
        if self.spec.text is None:
            return None
        try:
            return sha256_file(Path(self.source.resolve(self.spec.text)))
        except OSError:
            return None


def _source_key(source: ModelSource) -> dict:
    from optpipe.source.model_source import source_fingerprint

    return source_fingerprint(source)  # the reference's model (eager) and the tokenizer both come from it


def _median_ms(seconds) -> float:
    return statistics.median(seconds) * 1e3
