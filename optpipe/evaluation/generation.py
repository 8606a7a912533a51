"""Generation with a KV cache: greedy decoding, time to first token, decode tokens/s, next-token
agreement and perplexity, for an exported decoder (ONNX Runtime or OpenVINO) and PyTorch eager.

Every runner is one `forward(input_ids, attention_mask, past) -> (logits, presents)`;
the loop around it is the same for all, so the figures differ only by the runtime. Prefill is a step
with an empty past (length 0) over the whole prompt: its time is the time to first token; each
later step feeds one token and the previous presents. Prompts of one batch have equal lengths
(tokenized ids cut to the shortest), so no padding is needed: the positions are the cache's.

Speed is compared, never asserted: `compare_speed` interleaves the runners round by round in one
process (DESIGN.md, "Measuring honestly") and reports medians.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from optpipe.core.errors import OptpipeError, UserInputError
from optpipe.source.decoder_export import ATTENTION_MASK, INPUT_IDS, DecoderLayout, cache_keyword, cache_of


class GenerationError(OptpipeError):
    """A generation that cannot be trusted (non-finite logits): one line naming what to change."""


class Runner(Protocol):
    name: str

    def forward(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits [batch, sequence, vocab], presents) of one step."""


def empty_past(layout: DecoderLayout, batch: int) -> list[np.ndarray]:
    return [np.zeros((batch, layout.kv_heads, 0, layout.head_dim), np.float32) for _ in layout.past_names]


class OrtRunner:
    def __init__(self, path: Path, layout: DecoderLayout, threads: int, name: str = "ort", session=None):
        """`session`: one of `path` built already (the self-check's, for its two checks)."""
        from optpipe.core.runtime import ort_session

        self.name, self.layout = name, layout
        self.session = session if session is not None else ort_session(Path(path), threads)
        self.outputs = ["logits", *layout.present_names]

    def forward(self, ids, mask, past):
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(self.layout.past_names, past))}
        logits, *presents = self.session.run(self.outputs, feeds)
        return logits, presents

    def close(self) -> None:
        self.session = None  # the session holds the weights: released as soon as the stage is measured


class OpenVinoRunner:
    def __init__(self, path: Path, layout: DecoderLayout, threads: int, hint: str = "f32", name: str = "openvino"):
        from optpipe.evaluation import openvino_runtime as ovr

        self.name, self.layout = name, layout
        self.compiled = ovr.compile_model(Path(path), threads, hint)
        self.request = self.compiled.create_infer_request()
        self.outputs = {port.get_any_name(): port for port in self.compiled.outputs}

    def forward(self, ids, mask, past):
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, **dict(zip(self.layout.past_names, past))}
        from optpipe.evaluation.openvino_runtime import check_not_emptied

        result = self.request.infer(feeds)
        logits = np.array(result[self.outputs["logits"]])
        check_not_emptied({"logits": logits}, {INPUT_IDS: ids})
        return logits, [np.array(result[self.outputs[n]]) for n in self.layout.present_names]

    def close(self) -> None:
        self.request = self.compiled = None


class _EagerPast(list):
    """EagerRunner's presents (arrays, as every runner returns them) with the transformers cache they are views of.
    The next step continues that cache itself: one rebuilt from the arrays loses what a sliding-window layer's cache
    knows beyond them (it keeps only its window, not how many tokens it has seen), and the positions the model
    derives from it went wrong once a generation passed the window (a tiny Gemma 3, window 8: 2 of 16 greedy tokens
    differed from the same model run without a cache; continued, none did)."""

    cache: object = None


class EagerRunner:
    """PyTorch eager with transformers' own KV cache (DynamicCache): the baseline to beat."""

    def __init__(self, model, layout: DecoderLayout, threads: int, name: str = "eager"):
        self.name, self.model, self.layout, self.threads = name, model, layout, threads
        self.cache_keyword = cache_keyword(model)

    def forward(self, ids, mask, past):
        import torch
        from transformers import DynamicCache

        torch.set_num_threads(self.threads)
        if isinstance(past, _EagerPast):
            cache = past.cache  # this runner's own previous step: its cache goes on as transformers keeps it
        else:
            cache = DynamicCache(config=self.model.config)
            if past and past[0].shape[2]:
                for i in range(self.layout.layers):
                    cache.update(torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1]), i)
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), use_cache=True,
                             **{self.cache_keyword: cache})
        presents = _EagerPast()
        presents.cache = cache_of(out)
        for layer in presents.cache.layers[: self.layout.layers]:
            presents += [layer.keys.numpy(), layer.values.numpy()]
        return out.logits.float().numpy(), presents

    def close(self) -> None:
        pass


@dataclass
class Generation:
    tokens: np.ndarray  # [batch, new tokens]
    ttft_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.tokens.shape[1] - 1
        return self.tokens.shape[0] * steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


def check_prompt(prompt: np.ndarray, new_tokens: int, layout: DecoderLayout) -> None:
    batch, length = prompt.shape
    if batch > layout.max_batch:
        raise UserInputError(f"a batch of {batch} prompts is more than the export's max batch {layout.max_batch}; "
                             f"export with a larger max_batch or lower the batch size")
    if length > layout.max_sequence:
        raise UserInputError(f"the prompt has {length} tokens, more than the export's max sequence {layout.max_sequence}; "
                             f"shorten the prompt or export with max_sequence >= {length}")
    if length + new_tokens > layout.max_past + 1:
        raise UserInputError(f"{length} prompt tokens + {new_tokens} new ones exceed the export's max past length "
                             f"{layout.max_past}; generate fewer tokens or export with max_past >= {length + new_tokens}")


def greedy(runner: Runner, layout: DecoderLayout, prompt: np.ndarray, new_tokens: int) -> Generation:
    """Greedy decoding of `new_tokens` after `prompt` [batch, length] (int64)."""
    check_prompt(prompt, new_tokens, layout)
    batch, length = prompt.shape
    mask = np.ones((batch, length), np.int64)
    started = time.perf_counter()
    logits, past = runner.forward(prompt.astype(np.int64), mask, empty_past(layout, batch))
    ttft = time.perf_counter() - started
    tokens = [_next_token(logits[:, -1], runner.name, 0)]
    started = time.perf_counter()
    for step in range(1, new_tokens):
        mask = np.ones((batch, length + step), np.int64)
        logits, past = runner.forward(tokens[-1][:, None], mask, past)
        tokens.append(_next_token(logits[:, -1], runner.name, step))
    return Generation(np.stack(tokens, axis=1), ttft, time.perf_counter() - started)


def _next_token(logits: np.ndarray, runner: str, step: int) -> np.ndarray:
    if not np.isfinite(logits).all():
        raise GenerationError(f"{runner}: the logits of generated token {step + 1} are not finite (NaN/inf); "
                              "this stage's numerics are broken: exclude the layers it quantized (`exclude`) or use 8 bits")
    return logits.argmax(-1).astype(np.int64)


def forced_agreement(runner: Runner, layout: DecoderLayout, prompt: np.ndarray, reference: np.ndarray) -> float:
    """Next-token agreement under teacher forcing: the runner reads the prompt and then the reference's
    own generated tokens, and at each position its greedy choice is compared with the reference's next
    token. Free-running tokens would compare continuations of different texts after the first miss."""
    batch, length = prompt.shape
    logits, past = runner.forward(prompt, np.ones((batch, length), np.int64), empty_past(layout, batch))
    hits = [_next_token(logits[:, -1], runner.name, 0) == reference[:, 0]]
    for step in range(1, reference.shape[1]):
        logits, past = runner.forward(reference[:, step - 1: step], np.ones((batch, length + step), np.int64), past)
        hits.append(_next_token(logits[:, -1], runner.name, step) == reference[:, step])
    return float(np.stack(hits, axis=1).mean())


def perplexity(runner: Runner, layout: DecoderLayout, ids: np.ndarray, window: int | None = None) -> float:
    """exp(mean next-token NLL) over `ids` [1, n], fed in windows of at most the export's max sequence,
    each window continuing the previous one's cache (so every token sees all before it)."""
    window = min(window or layout.max_sequence, layout.max_sequence)
    total, count, past = 0.0, 0, empty_past(layout, 1)
    seen = 0
    for start in range(0, ids.shape[1] - 1, window):
        chunk = ids[:, start: start + window]
        if seen + chunk.shape[1] > layout.max_past:
            break  # the cache cannot grow further: the figure covers the tokens before this point
        logits, past = runner.forward(chunk, np.ones((1, seen + chunk.shape[1]), np.int64), past)
        targets = ids[0, start + 1: start + 1 + chunk.shape[1]]
        total += _nll(logits[0, : len(targets)], targets)
        del logits  # a window's logits: [window, vocab], 134 MB at Gemma's 262k vocabulary
        count += len(targets)
        seen += chunk.shape[1]
    if not np.isfinite(total):
        raise GenerationError(f"{runner.name}: perplexity is not finite: the stage produces NaN/inf logits")
    return float(np.exp(total / max(count, 1)))


#: Rows of logits turned into log-probabilities at a time: the float64 copies of a whole window (128 x 262k
#: vocabulary) were 0.27 GB each, three of them at once; 16 rows are 34 MB.
NLL_ROWS = 16


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of `targets` under `logits` [n, vocab], in float64, NLL_ROWS rows at a time."""
    total = 0.0
    for first in range(0, len(targets), NLL_ROWS):
        scores = logits[first: first + NLL_ROWS].astype(np.float64)
        picked = targets[first: first + NLL_ROWS]
        top = scores.max(-1)
        scores -= top[:, None]
        log_norm = top + np.log(np.exp(scores, out=scores).sum(-1))
        chosen = logits[np.arange(first, first + len(picked)), picked].astype(np.float64)
        total += float((log_norm - chosen).sum())
    return total


@dataclass
class SpeedRow:
    name: str
    batch: int
    ttft_ms: float
    decode_tokens_per_s: float
    same_tokens: float | None = None  # share of free-running generated tokens equal to the reference's
    rounds: int = 0
    tokens: np.ndarray | None = field(default=None, repr=False)


def compare_speed(runners: list[Runner], layout: DecoderLayout, prompt: np.ndarray, new_tokens: int,
                  rounds: int = 3, reference: str | None = None, progress: Callable[[str], None] = lambda _: None) -> list[SpeedRow]:
    """Each runner generates once per round, in turn (interleaved); medians over the rounds after a
    warm-up generation each. same_tokens: against `reference`'s tokens (default the first runner's)."""
    for runner in runners:
        greedy(runner, layout, prompt, min(new_tokens, 2))  # warm-up: first-run allocations, kernel choice
    times: dict[str, list[Generation]] = {r.name: [] for r in runners}
    for index in range(rounds):
        for runner in runners:
            times[runner.name].append(greedy(runner, layout, prompt, new_tokens))
        progress(f"round {index + 1}/{rounds}")
    reference_tokens = times[reference or runners[0].name][0].tokens
    rows = []
    for runner in runners:
        runs = times[runner.name]
        rows.append(SpeedRow(
            name=runner.name, batch=prompt.shape[0], rounds=rounds, tokens=runs[0].tokens,
            ttft_ms=statistics.median(g.ttft_s for g in runs) * 1e3,
            decode_tokens_per_s=statistics.median(g.decode_tokens_per_s for g in runs),
            same_tokens=float((runs[0].tokens == reference_tokens).mean()),
        ))
    return rows
