"""A decoder's OpenVINO IR in the form OpenVINO GenAI's LLMPipeline loads: `<target>/genai/`.

optpipe's decoder IR is stateless (past_key_values.<i>.key/value in, present.<i>.key/value out:
optpipe's own generation loop feeds them). GenAI's LLMPipeline drives a *stateful* model, the form
optimum-intel exports: the KV cache as internal state (ReadValue/Assign) and a `beam_idx` input that
reorders the cache's batch rows. This module turns the target's IR into that form with public API
only (a Gather by `beam_idx` on each past input, then `openvino.passes.MakeStateful` over the
past/present pairs), writes it as `openvino_model.xml` beside a `generation_config.json` (GenAI
refuses to generate without an eos token id) and, where the recipe's Hugging Face folder has a
tokenizer, `openvino_tokenizer.xml` / `openvino_detokenizer.xml` from openvino-tokenizers'
`convert_tokenizer` (offline: the local folder only).

Then, where openvino-genai is installed, LLMPipeline loads the folder and generates greedy tokens
from a token-id prompt; they must equal optpipe's own loop on the stateless IR, or the folder is
removed (a GenAI artifact that generates other tokens than the measured one is not deployed).

Measured (openvino-genai 2026.4.1): LLMPipeline takes the stateful IR on its SDPA backend; its
PagedAttention backend (continuous batching, `ATTENTION_BACKEND: PA`) refuses it: "No
ScaledDotProductAttention operation observed in the graph" (the ONNX graph's attention is MatMul +
Softmax, which the converter does not fuse into SDPA). No position_ids input is needed: the graph
derives positions from the cache length.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optpipe.core.runtime import PAST_PREFIX
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.source.decoder_export import INPUT_IDS, DecoderLayout
from optpipe.targets import decoder_facts as facts

FOLDER = "genai"
MODEL = "openvino_model.xml"
BEAM_IDX = "beam_idx"
CHECK_TOKENS = 6


def decoder_layout(ir_path: Path) -> DecoderLayout | None:
    """The KV-cache layout of a stateless decoder IR (its past_key_values inputs), or None for any other model."""
    model = ovr.read_model(ir_path)
    pasts = {p.get_any_name(): p.get_partial_shape() for p in model.inputs if p.get_any_name().startswith(PAST_PREFIX)}
    first = pasts.get(f"{PAST_PREFIX}0.key")
    if first is None or len(first) != 4 or not (first[1].is_static and first[3].is_static):
        return None
    vocab = next((p.get_partial_shape()[-1] for p in model.outputs if "logits" in p.get_names()), None)
    vocab_size = vocab.get_length() if vocab is not None and vocab.is_static else 0
    return DecoderLayout(layers=len(pasts) // 2, kv_heads=first[1].get_length(), head_dim=first[3].get_length(),
                         vocab=vocab_size, max_batch=1, max_sequence=CHECK_TOKENS, max_past=2 * CHECK_TOKENS + 1)


def stateful(ir_path: Path, layout: DecoderLayout):
    """The IR with its cache as state and a beam_idx input (optimum-intel's form), through public API."""
    import openvino as ov
    import openvino.passes as ovp
    from openvino import opset13

    model = ovr.read_model(ir_path)
    batch = model.input(INPUT_IDS).get_partial_shape()[0]
    beam_idx = opset13.parameter(ov.PartialShape([batch]), ov.Type.i32, name=BEAM_IDX)
    beam_idx.output(0).get_tensor().set_names({BEAM_IDX})
    model.add_parameters([beam_idx])
    for name in layout.past_names:
        # GenAI selects cache rows (beam search) through beam_idx: a Gather on each past, before it becomes state.
        port = model.input(name)
        consumers = port.get_target_inputs()
        gathered = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    model.validate_nodes_and_infer_types()
    manager = ovp.Manager()
    manager.register_pass(ovp.MakeStateful(dict(zip(layout.past_names, layout.present_names))))
    manager.run_passes(model)
    return model


def write_genai(ir_path: Path, target_folder: Path, source, config: dict[str, Any]) -> dict[str, Any] | None:
    """`target_folder/genai/` for a decoder IR, checked in openvino-genai where it is installed; what was
    written and verified (the target's details), or None when the IR is not a decoder. `config`: the CPU
    compile settings the IR was measured with (openvino.json's), which LLMPipeline must be given too:
    left to its default, the CPU plugin runs bf16 on an AMX machine where optpipe measured f32."""
    import openvino as ov

    layout = decoder_layout(ir_path)
    if layout is None:
        return None
    folder = target_folder / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ov.save_model(stateful(ir_path, layout), str(folder / MODEL), compress_to_fp16=False)
    generation = facts.generation_config(source)
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    written: dict[str, Any] = {"folder": FOLDER, "form": "stateful (MakeStateful, beam_idx)", "tokenizer": _tokenizer(source, folder),
                             "properties": "openvino.json's config (LLMPipeline(folder, 'CPU', **config))"}
    if facts.eos(generation) is None:
        written["eos"] = "the model's config names no eos_token_id: set GenerationConfig.eos_token_id before generate()"
    written["check"] = check(folder, ir_path, layout, config, facts.eos(generation))
    if written["check"].get("same_tokens") is False:
        shutil.rmtree(folder, ignore_errors=True)
        written["folder"] = None
    return written


def check(folder: Path, ir_path: Path, layout: DecoderLayout, config: dict[str, Any], eos: int | None) -> dict[str, Any]:
    """Greedy tokens of LLMPipeline on `folder` against optpipe's loop on the stateless IR (same prompt)."""
    try:
        import openvino_genai  # noqa: F401
    except ImportError:
        return {"verified": False, "reason": "openvino-genai is not installed (pip install 'optpipe[genai]')"}
    from optpipe.evaluation import generation as gen

    vocab = layout.vocab or 2
    prompt = (np.arange(CHECK_TOKENS, dtype=np.int64)[None] * 7 + 3) % vocab
    runner = gen.OpenVinoRunner(ir_path, layout, config["INFERENCE_NUM_THREADS"], config.get("INFERENCE_PRECISION_HINT", "f32"))
    expected = gen.greedy(runner, layout, prompt, CHECK_TOKENS).tokens
    runner.close()
    try:
        tokens = generate(folder, prompt, CHECK_TOKENS, config, eos)
    except RuntimeError as exc:
        return {"verified": True, "same_tokens": False, "reason": f"LLMPipeline failed: {str(exc).strip().splitlines()[-1]}"}
    same = tokens.shape == expected.shape and bool((tokens == expected).all())
    return {"verified": True, "same_tokens": same, "tokens": int(expected.size), "runtime": f"openvino-genai {_version()}"}


def generate(folder: Path, prompt: np.ndarray, new_tokens: int, properties: dict[str, Any], eos: int | None = None) -> np.ndarray:
    """Greedy tokens [batch, new_tokens] from openvino_genai.LLMPipeline on token ids (no tokenizer needed);
    `ignore_eos` so that exactly `new_tokens` come back, as optpipe's own loop generates them."""
    import openvino as ov
    import openvino_genai as og

    pipe = og.LLMPipeline(str(folder), "CPU", **properties)
    config = pipe.get_generation_config()
    config.max_new_tokens, config.do_sample, config.ignore_eos = new_tokens, False, True
    if eos is not None or config.eos_token_id < 0:
        config.eos_token_id = eos if eos is not None else 0  # GenAI refuses a config without one, even ignoring it
        config.stop_token_ids = {config.eos_token_id}
    inputs = og.TokenizedInputs(ov.Tensor(prompt.astype(np.int64)), ov.Tensor(np.ones_like(prompt, dtype=np.int64)))
    return np.array(pipe.generate(inputs, config).tokens, dtype=np.int64)


def _tokenizer(source, folder: Path) -> str:
    """openvino_tokenizer.xml / openvino_detokenizer.xml from the recipe's local tokenizer, where there is one."""
    hf = facts.tokenizer_folder(source)
    if hf is None:
        return "none: the model has no tokenizer folder; generate from token ids (TokenizedInputs)"
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
        encoder, decoder = convert_tokenizer(tokenizer, with_detokenizer=True)
        ov.save_model(encoder, str(folder / "openvino_tokenizer.xml"))
        ov.save_model(decoder, str(folder / "openvino_detokenizer.xml"))
    except ImportError:
        return "not converted: openvino-tokenizers is not installed (pip install 'optpipe[genai]')"
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted errors on tokenizers it cannot translate
        return f"not converted ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}); generate from token ids"
    return f"converted from {hf.name} (openvino-tokenizers)"


def _version() -> str:
    from importlib.metadata import version

    return version("openvino-genai")
