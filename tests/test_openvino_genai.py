"""A decoder's OpenVINO IR in OpenVINO GenAI's stateful form (optpipe/targets/openvino_genai.py):
openvino_genai.LLMPipeline loads the folder the target writes and generates the same greedy tokens
as optpipe's own loop and as PyTorch eager, for the FP32 IR, an NNCF INT4 IR and a model with a
tokenizer (text in, text out). Tiny Llama decoders built here (2 layers, hidden 64)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from optpipe.evaluation import generation as gen
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.source.decoder_export import export_decoder
from optpipe.targets import openvino_genai as genai
from helpers_decoders import (PROMPT, SHAPE, config_source, hf_folder_with_tokenizer, skip_compressed_under_isa_restriction,
                              tiny_llama)

pytest.importorskip("openvino_genai")
CONFIG = ovr.compile_config(1)




@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """(eager model, its layout, a stateless FP32 IR of its KV-cache export)."""
    model = tiny_llama()
    folder = tmp_path_factory.mktemp("genai-llama")
    layout = export_decoder(model, folder / "onnx", max_batch=2, max_sequence=16, max_past=40)
    ovr.save_ir(ovr.convert_onnx(folder / "onnx" / "model.onnx"), folder / "ir")
    return model, layout, folder / "ir" / ovr.IR_FILE


def test_llm_pipeline_generates_eagers_tokens_from_the_stateful_ir(decoder, tmp_path):
    model, layout, ir = decoder
    facts = genai.write_genai(ir, tmp_path, config_source(tmp_path), CONFIG)
    assert facts["check"] == {"verified": True, "same_tokens": True, "tokens": genai.CHECK_TOKENS,
                              "runtime": facts["check"]["runtime"]}
    folder = tmp_path / genai.FOLDER
    # Stateful: the cache is hidden, beam_idx added; the eos comes from LlamaConfig's defaults (no hf folder).
    assert facts["tokenizer"].startswith("none") and "eos" not in facts
    inputs = {p.get_any_name() for p in ovr.read_model(folder / genai.MODEL).inputs}
    assert inputs == {"input_ids", "attention_mask", "beam_idx"}
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_token_id
    # At batch 2 and more tokens than the check: GenAI's tokens are eager's (with its own DynamicCache).
    expected = gen.greedy(gen.EagerRunner(model, layout, 1), layout, PROMPT, 10).tokens
    np.testing.assert_array_equal(genai.generate(folder, PROMPT, 10, CONFIG), expected)


def test_an_nncf_int4_ir_runs_in_genai_as_in_optpipes_loop(decoder, tmp_path):
    import nncf

    skip_compressed_under_isa_restriction()
    _, layout, ir = decoder
    compressed = nncf.compress_weights(ovr.read_model(ir), mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32, ratio=1.0)
    ovr.save_ir(compressed, tmp_path / "int4")
    facts = genai.write_genai(tmp_path / "int4" / ovr.IR_FILE, tmp_path, None, CONFIG)
    assert facts["check"]["same_tokens"] is True and "no eos_token_id" in facts["eos"]  # no source: no config to read
    own = gen.greedy(gen.OpenVinoRunner(tmp_path / "int4" / ovr.IR_FILE, layout, 1), layout, PROMPT, 8).tokens
    np.testing.assert_array_equal(genai.generate(tmp_path / genai.FOLDER, PROMPT, 8, CONFIG, eos=2), own)


def test_a_miswired_cache_fails_the_check_and_the_folder_is_removed(decoder, tmp_path, monkeypatch):
    # Each layer's key state fed from its value output: LLMPipeline still runs, and generates other tokens.
    _, _, ir = decoder
    real = genai.stateful

    def swapped(path, layout):
        import dataclasses

        class Swapped(type(layout)):
            @property
            def present_names(self):
                return [f"present.{i}.{kind}" for i in range(self.layers) for kind in ("value", "key")]

        return real(path, Swapped(**dataclasses.asdict(layout)))

    monkeypatch.setattr(genai, "stateful", swapped)
    facts = genai.write_genai(ir, tmp_path, None, CONFIG)
    assert facts["check"]["same_tokens"] is False and facts["folder"] is None
    assert not (tmp_path / genai.FOLDER).exists()


def test_a_model_that_is_not_a_decoder_gets_no_genai_folder(tmp_path):
    import openvino as ov
    from openvino import opset13

    x = opset13.parameter([1, 8], np.float32, name="x")
    ovr.save_ir(ov.Model([opset13.relu(x)], [x]), tmp_path / "mlp")
    assert genai.write_genai(tmp_path / "mlp" / ovr.IR_FILE, tmp_path, None, CONFIG) is None
    assert not (tmp_path / genai.FOLDER).exists()


def test_the_hf_folders_tokenizer_is_converted_and_text_generates_as_token_ids_do(tmp_path):
    from transformers import AutoTokenizer

    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import ModelSource

    hf = hf_folder_with_tokenizer(tmp_path / "hf")
    model = tiny_llama(vocab=len(AutoTokenizer.from_pretrained(str(hf))), bos_token_id=0, eos_token_id=1)
    model.save_pretrained(hf)  # config.json, generation_config.json, model.safetensors beside the tokenizer
    layout = export_decoder(model, tmp_path / "onnx", max_batch=2, max_sequence=16, max_past=40)
    ovr.save_ir(ovr.convert_onnx(tmp_path / "onnx" / "model.onnx"), tmp_path / "ir")
    source = ModelSource((), {}, HFModel(hf=str(hf), task="causal-lm"), tmp_path)
    facts = genai.write_genai(tmp_path / "ir" / ovr.IR_FILE, tmp_path, source, CONFIG)
    assert facts["check"]["same_tokens"] is True and facts["tokenizer"].startswith("converted from hf")
    folder = tmp_path / genai.FOLDER
    assert (folder / "openvino_tokenizer.xml").is_file() and (folder / "openvino_detokenizer.xml").is_file()
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 1  # the folder's own file

    import openvino_genai as og

    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    text = "every pass is measured"
    ids = np.array([tokenizer(text)["input_ids"]], np.int64)
    expected = gen.greedy(gen.OpenVinoRunner(tmp_path / "ir" / ovr.IR_FILE, layout, 1), layout, ids, 6).tokens[0]
    pipe = og.LLMPipeline(str(folder), "CPU", **CONFIG)
    config = pipe.get_generation_config()
    config.max_new_tokens, config.do_sample, config.ignore_eos = 6, False, True
    assert pipe.generate(text, config) == tokenizer.decode(expected.tolist())
    assert pipe.get_tokenizer().encode(text).input_ids.data.tolist() == ids.tolist()


def test_compile_writes_the_genai_folder_for_an_openvino_decoder_stage(tmp_path, cli_run):
    """optpipe compile with an openvino target on an NNCF INT4 decoder stage: the target's folder has genai/,
    checked in LLMPipeline against optpipe's loop, and the report's target row says so."""
    import yaml

    skip_compressed_under_isa_restriction()
    recipe = {
        "name": "tiny-decoder-genai",
        "model": {"hf_config": {"model_type": "llama", "vocab_size": 256, **SHAPE, "tie_word_embeddings": False},
                  "task": "causal-lm", "outputs": ["logits"]},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 256]}],
        # batch max 1: the export's generation check ran a batch of 2 and failed the stage ("more than the
        # export's max batch 1"), and torch.export refused the dim (min == max) before that.
        "dims": {"batch": {"min": 1, "opt": 1, "max": 1}, "sequence": {"min": 2, "opt": 8, "max": 32}},
        "data": {"eval": {"source": "synthetic", "samples": 2}},
        "stages": {"export": {"pass": "export"},
                   "ov_int4": {"pass": "openvino_weights", "after": "export", "params": {"mode": "int4_sym", "group_size": 32}}},
        "evaluate": {"task": {"kind": "language-model"}, "threads": 1, "warmup": 1, "iterations": 2,
                     "generation": {"new_tokens": 4, "batch_sizes": [1], "rounds": 1, "max_past": 40}},
        "targets": [{"kind": "openvino", "stages": ["ov_int4"]}, {"kind": "ort", "stages": ["export"]}],
        "output": str(tmp_path / "run"),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = cli_run("compile", str(path))
    assert result.exit_code in (0, 1), result.output  # 1: int4 on random weights out of tolerance, a verdict
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    row = next(t for t in report["targets"] if t["kind"] == "openvino")
    assert row["status"] == "ok", row
    facts = row["details"]["genai"]
    assert facts["folder"] == genai.FOLDER and facts["check"]["same_tokens"] is True, facts
    assert json.loads((tmp_path / "run" / row["path"] / genai.FOLDER / "generation_config.json").read_text())["eos_token_id"] == 2
    assert any(name.startswith("genai/") for name in row["files"])
    # The ORT bundle of the export stage: genai_config.json beside model.onnx, checked where onnxruntime-genai imports.
    ort = next(t for t in report["targets"] if t["kind"] == "ort")
    assert ort["status"] == "ok" and "genai_config.json" in ort["files"], ort["details"]
    check = ort["details"]["genai"]["check"]
    assert check.get("same_tokens") is True or (check["verified"] is False and "not installed" in check["reason"]), check
