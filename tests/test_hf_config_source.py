"""Model source `hf_config`: a Hugging Face architecture from its config, random seeded weights."""
from __future__ import annotations

import numpy as np
import pytest

from optpipe.core.errors import ModelSourceError, RecipeError
from optpipe.safety.recipe_loading import parse_recipe

TINY_BERT = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
             "intermediate_size": 64, "vocab_size": 100}


def recipe(model: dict):
    return parse_recipe(
        {
            "model": model,
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 8], "range": [0, 100]},
                       {"name": "attention_mask", "dtype": "int64", "shape": ["batch", 8], "fill": 1}],
            "dims": {"batch": {"min": 1, "opt": 2, "max": 4}},
            "stages": {"export": {"pass": "export"}},
        }
    )


def test_builds_the_architecture_with_seeded_random_weights():
    from optpipe.source.model_source import load_torch_model, source_fingerprint

    spec = recipe({"hf_config": TINY_BERT, "seed": 3})
    first, second = load_torch_model(spec.model_source()), load_torch_model(spec.model_source())
    assert "random weights, seed 3" in first.description
    assert first.output_names == ["last_hidden_state", "pooler_output"]
    weights = [p.detach().numpy() for p in first.module.parameters()]
    assert all(np.array_equal(a, b.detach().numpy()) for a, b in zip(weights, second.module.parameters()))
    assert source_fingerprint(spec.model_source())["weights"] == "random"
    assert source_fingerprint(spec.model_source()) != source_fingerprint(recipe({"hf_config": TINY_BERT, "seed": 4}).model_source())


def test_config_without_model_type_is_a_recipe_error():
    with pytest.raises(RecipeError, match="model_type"):
        recipe({"hf_config": {"hidden_size": 32}})


def test_text_data_without_a_tokenizer_says_what_to_add():
    from optpipe.source.model_source import hf_folder

    with pytest.raises(ModelSourceError, match="model.tokenizer"):
        hf_folder(recipe({"hf_config": TINY_BERT}).model_source())
