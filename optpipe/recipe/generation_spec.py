"""evaluate.generation: how a decoder with a KV cache is measured as a decoder (greedy generation
from the recipe's prompts), not as one forward over a fixed sequence.

With it, the export stage writes the graph with past key/values (optpipe/source/decoder_export.py)
and every stage's evaluation is evaluation/generation_eval.py's: time to first token, decode
tokens/s per batch size, next-token agreement with PyTorch eager over the generated tokens, and
perplexity on `text`.
"""
from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import Field

from optpipe.recipe.model_specs import Strict

#: Prompts when the recipe names none: plain English (a tokenizer's or byte tokens).
DEFAULT_PROMPTS = ("The quick brown fox", "In a compiler, every pass")


class GenerationSpec(Strict):
    prompts: list[Union[str, list[Annotated[int, Field(ge=0)]]]] = Field(
        default_factory=lambda: list(DEFAULT_PROMPTS), min_length=1,
        description="text (tokenized with the model's tokenizer, else as UTF-8 bytes) or token id lists; a batch of "
        "b takes the first b prompts (repeated when fewer), cut to the shortest so that no padding is needed")
    new_tokens: int = Field(16, ge=2, le=4096, description="tokens generated greedily after each prompt")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1], min_length=1, description="decode tokens/s is measured at each (batch 1 always)")
    text: Optional[str] = Field(None, description="UTF-8 text file for perplexity (relative to the recipe); default: the prompts")
    text_tokens: int = Field(256, ge=2, le=65536, description="perplexity over at most this many tokens of `text`")
    max_past: Optional[int] = Field(
        None, ge=2, description="the export's longest KV cache; default: the sequence dim's max + new_tokens")
    rounds: int = Field(3, ge=1, le=100, description="timed generations per runtime, interleaved with eager's; medians")

    def all_batch_sizes(self) -> list[int]:
        return sorted({1, *self.batch_sizes})


#: Model tasks whose Hugging Face head is a causal LM: the only ones export_decoder exports with a KV cache.
CAUSAL_TASKS = ("causal-lm", "text-generation")
SEQ2SEQ_TASKS = ("seq2seq-lm", "text2text-generation", "speech-seq2seq")


def decoder_dims(spec: GenerationSpec, inputs, dims, tokens: str) -> tuple[int, int, int]:
    """(max batch, max sequence, max past) of the KV-cache export: the token input's two named dims'
    maxima, and `max_past` (default: the longest prompt the dims allow plus the new tokens)."""
    token_spec = next(s for s in inputs if s.name == tokens)
    batch, sequence = (dims[d].max if isinstance(d, str) else d for d in token_spec.shape[:2])
    return batch, sequence, spec.max_past or sequence + spec.new_tokens


def generation_problem(spec: GenerationSpec, task, model, inputs, dims) -> Optional[str]:
    """Why these generation settings cannot be measured on this recipe (one line naming what to change), or None."""
    from optpipe.recipe.model_specs import FactoryModel, HFConfigModel, HFModel, OnnxModel, TorchScriptModel, TorchvisionModel

    if task is None or task.kind != "language-model":
        return "evaluate.generation: needs `evaluate.task: {kind: language-model}` (generation measures a decoder)"
    if isinstance(model, (FactoryModel, TorchScriptModel, TorchvisionModel)):
        return ("evaluate.generation: a decoder needs an export with its KV cache, which optpipe writes only for Hugging Face "
                "causal LMs; use `model: {hf: FOLDER, task: causal-lm}` (or hf_config), or an ONNX decoder with past_key_values inputs")
    if isinstance(model, (HFModel, HFConfigModel)) and model.task in SEQ2SEQ_TASKS:
        return (f"evaluate.generation: model.task is {model.task}: generation with a KV cache is built for decoder-only "
                "models, not encoder-decoders; remove evaluate.generation (the teacher-forced forward is measured)")
    if isinstance(model, (HFModel, HFConfigModel)) and model.task not in CAUSAL_TASKS:
        return (f"evaluate.generation: model.task is {model.task}, which has no KV cache to export; "
                "set `model.task: causal-lm`, or remove evaluate.generation")
    token_spec = next((s for s in inputs if s.name == task.tokens), None)
    if token_spec is None or len(token_spec.shape) != 2:
        return f"evaluate.generation: needs a 2-D token input `{task.tokens}` [batch, sequence] (evaluate.task.tokens names it)"
    if not all(isinstance(d, str) for d in token_spec.shape):
        return f"evaluate.generation: inputs.{task.tokens}.shape must name two dims (e.g. [batch, sequence]) for the KV-cache export"
    max_batch, max_sequence, max_past = decoder_dims(spec, inputs, dims, task.tokens)
    too_big = [b for b in spec.all_batch_sizes() if b > max_batch]
    if too_big:
        return (f"evaluate.generation.batch_sizes: {too_big} above the export's max batch {max_batch} "
                f"(dims.{token_spec.shape[0]}.max); raise that max or lower the batch sizes")
    if isinstance(model, OnnxModel):
        return None  # the file's inputs are checked in preflight (a past_key_values input per layer)
    if max_past < 2 + spec.new_tokens:
        return (f"evaluate.generation.max_past: {max_past} leaves no room for a prompt and {spec.new_tokens} new tokens; "
                f"raise it to at least {max_sequence + spec.new_tokens}")
    return None
