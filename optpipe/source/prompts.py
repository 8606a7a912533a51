"""The recipe's generation prompts and perplexity text as token ids (evaluate.generation).

Tokens: the model's tokenizer where the recipe has one (an `hf` folder, or hf_config's `tokenizer`),
else the text's UTF-8 bytes modulo the vocabulary (a model built from a config has no tokenizer;
the report says which was used). Preflight reads them too: a prompt longer than the export's
sequence dim is refused before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optpipe.core.errors import RecipeError
from optpipe.recipe.generation_spec import GenerationSpec
from optpipe.recipe.schema import HFConfigModel, HFModel, ModelSource


@dataclass(frozen=True)
class Texts:
    prompts: list[np.ndarray]  # one [n] int64 array per prompt
    text: np.ndarray  # [1, n] int64: the perplexity text
    tokens: str  # how: "tokenizer <folder>" or "UTF-8 bytes mod <vocab>"


def weights_kind(source: ModelSource) -> str:
    if isinstance(source.model, HFConfigModel):
        return "random"
    return "checkpoint" if isinstance(source.model, HFModel) else "unknown"


def texts(spec: GenerationSpec, source: ModelSource, vocab: int, max_sequence: int) -> Texts:
    """The prompts and the text as ids; a prompt longer than the export's sequence dim is the recipe's to fix."""
    encode, how = _encoder(source, vocab)
    prompts = [np.asarray(p if isinstance(p, list) else encode(p), np.int64) for p in spec.prompts]
    for i, ids in enumerate(prompts):
        if len(ids) > max_sequence:
            raise RecipeError(f"evaluate.generation.prompts.{i}: {len(ids)} tokens, more than the export's max sequence "
                              f"{max_sequence} (the sequence dim's max); shorten the prompt or raise that dim's max")
        if len(ids) == 0:
            said = f" ({how} gives none for this text)" if spec.prompts[i] else ""
            raise RecipeError(f"evaluate.generation.prompts.{i}: no tokens{said}; give a non-empty prompt")
        if ids.max() >= vocab:
            raise RecipeError(f"evaluate.generation.prompts.{i}: token id {int(ids.max())} is outside the vocabulary ({vocab})")
    if spec.text is not None:
        path = source.resolve(spec.text)
        try:
            raw = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise RecipeError(f"evaluate.generation.text: cannot read '{path}' ({exc.strerror}); fix the path") from None
        text = np.asarray(encode(raw), np.int64)
    else:
        text = np.concatenate(prompts)
    if len(text) < 2:
        raise RecipeError("evaluate.generation.text: fewer than 2 tokens; perplexity needs a longer text")
    return Texts(prompts, text[: spec.text_tokens][None], how)


def _encoder(source: ModelSource, vocab: int):
    folder = _tokenizer_folder(source)
    if folder is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            if len(tokenizer) < 2:
                # transformers 5 builds an empty tokenizer (one special token; every text -> no ids) from a folder with
                # no tokenizer files for some model types (Phi's GPT2Tokenizer), where Llama's raises
                raise ValueError("no vocabulary")
            # verbose=False: the text is one stream cut into windows later; "longer than the maximum sequence
            # length ... will result in indexing errors" is not true of it
            return (lambda text: tokenizer(text, verbose=False)["input_ids"]), f"tokenizer {folder.name}"
        except (OSError, ValueError):
            pass  # a folder with weights but no tokenizer files: bytes, and the report says so
    return (lambda text: [b % vocab for b in text.encode("utf-8")]), f"UTF-8 bytes mod {vocab}"


def _tokenizer_folder(source: ModelSource) -> Path | None:
    from optpipe.source.model_source import hf_folder

    model = source.model
    if isinstance(model, HFModel) or (isinstance(model, HFConfigModel) and model.tokenizer is not None):
        return hf_folder(source)
    return None


def batch_prompt(prompts: list[np.ndarray], batch: int) -> np.ndarray:
    """[batch, length]: the first `batch` prompts (cycled), cut to the shortest: equal lengths, no padding."""
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    length = min(len(r) for r in rows)
    return np.stack([r[:length] for r in rows])
