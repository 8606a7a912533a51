"""A decoder's ORT bundle as ONNX Runtime GenAI loads it: `genai_config.json` (and the tokenizer's
files) beside `model.onnx`, so `onnxruntime_genai.Model(<bundle>)` runs the graph optpipe measured.

The graph already has GenAI's names (input_ids, attention_mask, past_key_values.<i>.key/value in;
logits, present.<i>.key/value out: source/decoder_export.py); what GenAI needs besides is the config
its model builder writes: the cache's shape (layers, kv heads, head size), the names, the special
token ids, and `past_present_share_buffer: false` (the graph concatenates past and new keys; a shared
buffer needs a cache of fixed max length). No position_ids input: the graph derives positions from
the cache length.

Then, where onnxruntime-genai imports, a Generator on the folder generates greedy tokens from a
token-id prompt: they must equal optpipe's own loop on the same model.onnx (up to GenAI's stop at
eos), or the config is removed and the target's details say why.

onnxruntime-genai 0.18 requires the `onnxruntime` wheel, which would overwrite the onnxruntime-gpu
this project installs (both are the `onnxruntime` package); its native library loads whichever
onnxruntime is installed (`_dll_directory.py` finds the package and dlopens capi/libonnxruntime.so),
and installed with `pip install --no-deps onnxruntime-genai` beside onnxruntime-gpu 1.31.1 it ran
(measured): that is how .ci/run installs it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optpipe.core.runtime import PAST_PREFIX
from optpipe.source.decoder_export import DecoderLayout
from optpipe.targets import decoder_facts as facts

CONFIG_FILE = "genai_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
CHECK_TOKENS = 6
#: onnxruntime-genai's model type for any decoder-only graph with the inputs and outputs above
GENERIC_TYPE = "decoder"
UNSUPPORTED_TYPE = "Unsupported model_type"  # its refusal of a type it has no class for


def decoder_layout(graph) -> DecoderLayout | None:
    """The KV-cache layout of an ONNX decoder graph (its past_key_values inputs), or None for any other model."""
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in graph.input}
    first = shapes.get(f"{PAST_PREFIX}0.key")
    if first is None or len(first) != 4 or not (first[1] and first[3]):
        return None
    logits = next((v for v in graph.output if v.name == "logits"), None)
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value if logits is not None else 0
    layers = sum(1 for name in shapes if name.startswith(PAST_PREFIX)) // 2
    return DecoderLayout(layers=layers, kv_heads=first[1], head_dim=first[3], vocab=vocab, max_batch=1,
                         max_sequence=CHECK_TOKENS, max_past=2 * CHECK_TOKENS + 1)


def genai_config(layout: DecoderLayout, source, threads: int) -> dict[str, Any]:
    """genai_config.json as onnxruntime-genai's model builder writes it, for optpipe's graph."""
    config = facts.hf_config(source, facts.hf_folder_of(source))
    generation = facts.generation_config(source)
    heads = getattr(config, "num_attention_heads", None) or layout.kv_heads
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    eos = generation.get("eos_token_id")
    model = {
        "type": getattr(config, "model_type", None) or "llama",
        "vocab_size": layout.vocab or getattr(config, "vocab_size", 0),
        "context_length": context,
        "bos_token_id": generation.get("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": generation.get("pad_token_id", facts.eos(generation)),
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                                "intra_op_num_threads": int(threads), "inter_op_num_threads": 1},
            "filename": "model.onnx",
            "head_size": layout.head_dim,
            "hidden_size": getattr(config, "hidden_size", None) or heads * layout.head_dim,
            "num_attention_heads": heads,
            "num_hidden_layers": layout.layers,
            "num_key_value_heads": layout.kv_heads,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                       "past_key_names": f"{PAST_PREFIX}%d.key", "past_value_names": f"{PAST_PREFIX}%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
        },
    }
    search = {"do_sample": bool(generation.get("do_sample", False)), "num_beams": 1, "num_return_sequences": 1,
              "max_length": context, "min_length": 0, "past_present_share_buffer": False, "early_stopping": True,
              "temperature": generation.get("temperature", 1.0), "top_k": generation.get("top_k", 50),
              "top_p": generation.get("top_p", 1.0), "repetition_penalty": generation.get("repetition_penalty", 1.0),
              "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}
    return {"model": {k: v for k, v in model.items() if v is not None}, "search": search}


def write_genai(folder: Path, graph, source, threads: int) -> dict[str, Any] | None:
    """genai_config.json (+ tokenizer files) in the bundle `folder` for a decoder graph, checked where
    onnxruntime-genai is installed; what was written (the target's details), or None for other models."""
    layout = decoder_layout(graph)
    if layout is None:
        return None
    config = genai_config(layout, source, threads)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    written: dict[str, Any] = {"config": CONFIG_FILE, "tokenizer": _copy_tokenizer(source, folder)}
    if "eos_token_id" not in config["model"]:
        written["eos"] = "the model's config names no eos_token_id: generation runs to max_length"
    written["check"] = check(folder, layout, facts.eos(config["model"]), threads)
    if UNSUPPORTED_TYPE in written["check"].get("reason", ""):
        # GenAI picks its model class by `type` and refuses a type it has no class for (gpt_neox, falcon, bloom,
        # stablelm...). optpipe's graph has the generic decoder's inputs and outputs (positions come from the cache
        # length), which GenAI's own "decoder" type runs: measured on those four, the same greedy tokens.
        written["type"] = (f"{GENERIC_TYPE}: onnxruntime-genai has no '{config['model'].get('type')}' model class, and "
                           "runs this graph as its generic decoder")
        config["model"]["type"] = GENERIC_TYPE
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        written["check"] = check(folder, layout, facts.eos(config["model"]), threads)
    if written["check"].get("same_tokens") is False:
        (folder / CONFIG_FILE).unlink(missing_ok=True)
        written["config"] = None
    return written


def check(folder: Path, layout: DecoderLayout, eos: int | None, threads: int) -> dict[str, Any]:
    """GenAI's greedy tokens on `folder` against optpipe's loop on its model.onnx (same prompt)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return {"verified": False, "reason": "onnxruntime-genai is not installed (pip install --no-deps onnxruntime-genai: "
                                             "its onnxruntime requirement would replace onnxruntime-gpu)"}
    from optpipe.evaluation import generation as gen

    prompt = (np.arange(CHECK_TOKENS, dtype=np.int64)[None] * 7 + 3) % (layout.vocab or 2)
    runner = gen.OrtRunner(folder / "model.onnx", layout, threads)
    expected = gen.greedy(runner, layout, prompt, CHECK_TOKENS).tokens
    runner.close()
    try:
        tokens = generate(folder, prompt, CHECK_TOKENS)
    except Exception as exc:  # noqa: BLE001 - onnxruntime_genai raises plain RuntimeError/OrtException on a bad config
        return {"verified": True, "same_tokens": False, "reason": f"onnxruntime-genai failed: {str(exc).strip().splitlines()[-1]}"}
    same = bool(all(_same_up_to_eos(t, e, eos) for t, e in zip(tokens, expected)))
    return {"verified": True, "same_tokens": same, "tokens": int(expected.size), "runtime": f"onnxruntime-genai {_version()}"}


def generate(folder: Path, prompt: np.ndarray, new_tokens: int) -> list[np.ndarray]:
    """Greedy new tokens per row from onnxruntime_genai on token ids (GenAI stops a row at eos)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + new_tokens, do_sample=False, batch_size=prompt.shape[0])
    generator = og.Generator(model, params)
    generator.append_tokens(prompt.astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [np.asarray(generator.get_sequence(i), np.int64)[prompt.shape[1]:] for i in range(prompt.shape[0])]


def _same_up_to_eos(tokens: np.ndarray, expected: np.ndarray, eos: int | None) -> bool:
    if len(tokens) == len(expected):
        return bool((tokens == expected).all())
    # GenAI ended the row early: only at an eos optpipe's loop generated there too.
    return eos is not None and 0 < len(tokens) < len(expected) and tokens[-1] == eos and bool((tokens == expected[: len(tokens)]).all())


def _copy_tokenizer(source, folder: Path) -> str:
    hf = facts.tokenizer_folder(source)
    copied = [name for name in TOKENIZER_FILES if hf is not None and (hf / name).is_file()]
    for name in copied:
        shutil.copyfile(hf / name, folder / name)
    if not copied:
        return "none: the model has no tokenizer folder; generate from token ids (Generator.append_tokens)"
    return f"copied from {hf.name}: {', '.join(copied)}"


def _version() -> str:
    from importlib.metadata import version

    return version("onnxruntime-genai")
