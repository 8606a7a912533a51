"""Decoders whose accuracy figures mean nothing say so: the reference's logits ~0, or tied at their maximum
(optpipe/evaluation/accuracy.py's warnings, carried by the generation evaluation)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from test_generation_report import decoder_recipe


@pytest.fixture
def compile_(cli_run, tmp_path):
    return lambda recipe: cli_run("compile", str(recipe), cache=tmp_path / "cache")


def test_a_decoder_whose_logits_are_flat_is_said_to_measure_nothing(tmp_path, compile_):
    """Real weights (an hf folder: no random-weights warning) whose LM head is zeros plus a constant bias: every
    position's logits tie, so greedy picks the lowest id for eager and every stage alike (agreement 1.000) and the
    perplexity is the vocabulary's size. Before, the rows read agreement 1.000 with no word of it."""
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(PhiConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, max_position_embeddings=128)).eval()
    torch.nn.init.zeros_(model.lm_head.weight)  # Phi's head has a bias: the logits are that constant everywhere
    torch.nn.init.constant_(model.lm_head.bias, 0.5)
    model.save_pretrained(tmp_path / "hf")
    recipe = decoder_recipe(tmp_path, stages={"export": {"pass": "export"}})
    data = yaml.safe_load(recipe.read_text())
    data["model"] = {"hf": str(tmp_path / "hf"), "task": "causal-lm", "outputs": ["logits"]}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    result = compile_(recipe)
    assert result.exit_code == 0, result.output
    export = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}["export"]
    assert export["generation"]["weights"] != "random" and export["generation"]["next_token_agreement"] == 1.0
    # The folder has no tokenizer files, where transformers 5 builds Phi an empty GPT2Tokenizer (every text -> no ids):
    # that is no tokenizer, and the prompts are bytes (before, "prompts.0: no tokens; give a non-empty prompt")
    assert export["generation"]["tokens"] == "UTF-8 bytes mod 256"
    assert export["generation"]["perplexity"] == pytest.approx(256, rel=1e-3)
    [warning] = [w for w in export["accuracy"]["warnings"] if "tie at their maximum" in w]
    assert "mean nothing" in warning
    assert "(meaningless: tied logits)" in (tmp_path / "run" / "report.md").read_text()


def test_tied_logits_are_judged_by_the_share_of_positions_that_tie():
    """Most positions tied: the warning; a few ties among real logits (a random draw's) are not."""
    from optpipe.evaluation.figure_warnings import tied_logits_warnings

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 50)).astype(np.float32)
    assert tied_logits_warnings(logits) == []
    logits[:5] = 1.0
    assert "5 of 8 prompt positions" in tied_logits_warnings(logits)[0]
    logits[1:5] = rng.normal(size=(4, 50))
    assert tied_logits_warnings(logits) == []  # 1 of 8
    assert tied_logits_warnings(np.zeros((0, 50), np.float32)) == []
