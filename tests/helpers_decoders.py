"""Tiny decoders for the GenAI runtime tests: a Llama of 2 layers (hidden 64) built from a config, the
recipe source that names it, and a Hugging Face folder with a byte-level BPE tokenizer trained here."""
from __future__ import annotations

from pathlib import Path

import numpy as np


SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}


def tiny_llama(vocab: int = 256, **extra):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SHAPE, **extra)).eval()


def config_source(tmp_path: Path):
    """The recipe's `model: {hf_config: ...}` (random weights, no folder): its eos comes from the config class."""
    from optpipe.recipe.model_specs import HFConfigModel
    from optpipe.recipe.schema import ModelSource

    return ModelSource((), {}, HFConfigModel(hf_config={"model_type": "llama", "vocab_size": 256, **SHAPE}, task="causal-lm"), tmp_path)


def hf_folder_with_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer trained here on a few lines, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    lines = ["a compiler turns a recipe into passes", "every pass is measured on the same inputs", "the quick brown fox"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


# Two prompts of 7 token ids, the GenAI tests' greedy-decoding input.
PROMPT = np.array([[5, 17, 99, 3, 42, 7, 11], [8, 1, 250, 33, 2, 19, 60]], np.int64)


def skip_compressed_under_isa_restriction():
    """OpenVINO 2026.4's compressed-weight layers fail or return empty outputs under ONEDNN_MAX_CPU_ISA=AVX2
    on an AVX-512 host; on an emulated AVX2 CPU (qemu-x86_64 -cpu Haswell) they ran with the right shapes.
    An artifact of the restriction, not of AVX2 CPUs."""
    import pytest

    from optpipe.hardware.cpu_features import engine_target

    if engine_target("openvino").restricted_by:
        pytest.skip("compressed weights do not run under ONEDNN_MAX_CPU_ISA on this host (an artifact of the restriction)")
