"""A decoder's ORT bundle in ONNX Runtime GenAI (optpipe/targets/ort_genai.py): genai_config.json beside
model.onnx, onnxruntime_genai generating the same greedy tokens as optpipe's own loop and PyTorch
eager, for the FP32 graph, a MatMulNBits INT4 graph and a model with a tokenizer. Tiny Llama decoders
built here (2 layers, hidden 64). onnxruntime-genai is installed with --no-deps (.ci/run): its
`onnxruntime` requirement would replace onnxruntime-gpu."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from optpipe.evaluation import generation as gen
from optpipe.source.decoder_export import export_decoder
from optpipe.targets import ort_genai
from helpers_decoders import PROMPT, config_source, hf_folder_with_tokenizer, tiny_llama

pytest.importorskip("onnxruntime_genai")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    model = tiny_llama()
    folder = tmp_path_factory.mktemp("ort-genai-llama")
    layout = export_decoder(model, folder / "onnx", max_batch=2, max_sequence=16, max_past=40)
    return model, layout, folder / "onnx"


def bundle(source_folder, tmp_path):
    folder = tmp_path / "bundle"
    shutil.copytree(source_folder, folder)
    return folder, onnx.load(str(folder / "model.onnx"), load_external_data=False).graph


def test_onnxruntime_genai_generates_eagers_tokens_from_the_bundle(decoder, tmp_path):
    model, layout, onnx_folder = decoder
    folder, graph = bundle(onnx_folder, tmp_path)
    facts = ort_genai.write_genai(folder, graph, config_source(tmp_path), threads=1)
    assert facts["check"]["verified"] and facts["check"]["same_tokens"], facts
    config = json.loads((folder / ort_genai.CONFIG_FILE).read_text())["model"]
    assert config["decoder"]["num_key_value_heads"] == 2 and config["decoder"]["head_size"] == 16
    assert config["eos_token_id"] == model.config.eos_token_id and config["type"] == "llama"
    # Batch 2, more tokens than the check: GenAI's tokens are eager's (its own DynamicCache), unless a row hit eos.
    expected = gen.greedy(gen.EagerRunner(model, layout, 1), layout, PROMPT, 10).tokens
    for tokens, row in zip(ort_genai.generate(folder, PROMPT, 10), expected):
        assert ort_genai._same_up_to_eos(tokens, row, model.config.eos_token_id), (tokens, row)


def test_an_int4_matmulnbits_bundle_runs_in_genai_as_in_optpipes_loop(decoder, tmp_path):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    _, layout, onnx_folder = decoder
    quantizer = MatMulNBitsQuantizer(onnx.load(str(onnx_folder / "model.onnx")), block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    folder = tmp_path / "int4"
    folder.mkdir()
    onnx.save_model(quantizer.model.model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert any(n.op_type == "MatMulNBits" for n in graph.node)
    facts = ort_genai.write_genai(folder, graph, None, threads=1)
    assert facts["check"]["same_tokens"] is True and "no eos_token_id" in facts["eos"]  # no source: no config to read
    own = gen.greedy(gen.OrtRunner(folder / "model.onnx", layout, 1), layout, PROMPT, 8).tokens
    for tokens, row in zip(ort_genai.generate(folder, PROMPT, 8), own):
        np.testing.assert_array_equal(tokens, row)


def test_a_miswired_config_fails_the_check_and_is_removed(decoder, tmp_path, monkeypatch):
    # Keys and values named the other way round: GenAI still runs, and generates other tokens.
    _, _, onnx_folder = decoder
    folder, graph = bundle(onnx_folder, tmp_path)
    real = ort_genai.genai_config

    def swapped(*args):
        config = real(*args)
        outputs = config["model"]["decoder"]["outputs"]
        outputs["present_key_names"], outputs["present_value_names"] = outputs["present_value_names"], outputs["present_key_names"]
        return config

    monkeypatch.setattr(ort_genai, "genai_config", swapped)
    facts = ort_genai.write_genai(folder, graph, None, threads=1)
    assert facts["check"]["same_tokens"] is False and facts["config"] is None
    assert not (folder / ort_genai.CONFIG_FILE).exists()


def test_a_graph_that_is_not_a_decoder_gets_no_config(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "mlp", [x], [y])
    assert ort_genai.write_genai(tmp_path, graph, None, threads=1) is None
    assert not (tmp_path / ort_genai.CONFIG_FILE).exists()


def test_the_hf_folders_tokenizer_is_copied_and_genai_encodes_as_transformers_does(tmp_path):
    import onnxruntime_genai as og
    from transformers import AutoTokenizer

    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import ModelSource

    hf = hf_folder_with_tokenizer(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    model = tiny_llama(vocab=len(tokenizer), bos_token_id=0, eos_token_id=1)
    model.save_pretrained(hf)
    # max_batch 1 (a recipe's batch dim with max 1): torch.export refused min == max before decoder_export allowed for it.
    export_decoder(model, tmp_path / "bundle", max_batch=1, max_sequence=16, max_past=40)
    graph = onnx.load(str(tmp_path / "bundle" / "model.onnx"), load_external_data=False).graph
    source = ModelSource((), {}, HFModel(hf=str(hf), task="causal-lm"), tmp_path)
    facts = ort_genai.write_genai(tmp_path / "bundle", graph, source, threads=1)
    assert facts["check"]["same_tokens"] is True and facts["tokenizer"].startswith("copied from hf: tokenizer.json")
    genai_model = og.Model(str(tmp_path / "bundle"))
    text = "every pass is measured"
    assert list(og.Tokenizer(genai_model).encode(text)) == tokenizer(text)["input_ids"]
    assert json.loads((tmp_path / "bundle" / ort_genai.CONFIG_FILE).read_text())["model"]["eos_token_id"] == 1


def test_a_model_type_genai_has_no_class_for_runs_as_its_generic_decoder(tmp_path):
    """GPT-NeoX (and Falcon, BLOOM, StableLM): GenAI refuses their model_type, and runs optpipe's graph of them as its
    generic `decoder`, with eager's tokens."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import ModelSource

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.25,
                                             bos_token_id=0, eos_token_id=1)).eval()
    model.save_pretrained(tmp_path / "hf")
    layout = export_decoder(model, tmp_path / "bundle", max_batch=2, max_sequence=16, max_past=40)
    graph = onnx.load(str(tmp_path / "bundle" / "model.onnx"), load_external_data=False).graph
    source = ModelSource((), {}, HFModel(hf=str(tmp_path / "hf"), task="causal-lm"), tmp_path)
    facts = ort_genai.write_genai(tmp_path / "bundle", graph, source, threads=1)
    assert facts["check"]["same_tokens"] is True and facts["type"].startswith("decoder: onnxruntime-genai has no 'gpt_neox'")
    assert json.loads((tmp_path / "bundle" / ort_genai.CONFIG_FILE).read_text())["model"]["type"] == "decoder"
    expected = gen.greedy(gen.EagerRunner(model, layout, 1), layout, PROMPT, 8).tokens
    for tokens, row in zip(ort_genai.generate(tmp_path / "bundle", PROMPT, 8), expected):
        assert ort_genai._same_up_to_eos(tokens, row, 1), (tokens, row)
