"""Decoders as decoders: a tiny Llama (and GPT-2) exported with its KV cache, greedy generation on
ONNX Runtime / OpenVINO agreeing with PyTorch eager's own cache, perplexity, weight-only INT4 on the
decoder graph, and the one-line refusals (prompt longer than the export, NaN logits)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from optpipe.core.artifact import ModelArtifact, save_model
from optpipe.core.errors import UserInputError
from optpipe.evaluation import generation as gen
from optpipe.source.decoder_export import export_decoder

PROMPT = np.array([[5, 17, 99, 3, 42, 7], [8, 1, 250, 33, 2, 19]], np.int64)


def tiny(kind: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":  # grouped-query attention: 4 heads, 2 KV heads
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        return LlamaForCausalLM(config).eval()
    config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny("llama")
    folder = tmp_path_factory.mktemp("decoder-llama")
    layout = export_decoder(model, folder / "fp32", max_batch=4, max_sequence=32, max_past=64)
    return model, layout, ModelArtifact.open(folder / "fp32"), folder


def test_greedy_generation_matches_eager_with_its_cache(exported):
    model, layout, artifact, _ = exported
    graph = onnx.load(str(artifact.path), load_external_data=False).graph
    assert [i.name for i in graph.input][:4] == ["input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.0.value"]
    past_dims = [d.dim_param for d in graph.input[2].type.tensor_type.shape.dim]
    assert past_dims[0] == "batch" and past_dims[2] == "past_sequence"
    eager = gen.EagerRunner(model, layout, threads=1)
    ort = gen.OrtRunner(artifact.path, layout, threads=1)
    reference = gen.greedy(eager, layout, PROMPT, 12)
    candidate = gen.greedy(ort, layout, PROMPT, 12)
    assert reference.tokens.shape == (2, 12)
    np.testing.assert_array_equal(candidate.tokens, reference.tokens)
    assert gen.forced_agreement(ort, layout, PROMPT, reference.tokens) == 1.0
    # Perplexity through the cache in windows equals one pass over the text (FP32: to 1e-4).
    text = np.random.default_rng(1).integers(0, 256, (1, 40))
    assert gen.perplexity(ort, layout, text, window=16) == pytest.approx(gen.perplexity(eager, layout, text), rel=1e-4)


@pytest.mark.slow
def test_gpt2_exports_and_generates_as_eager(tmp_path):
    """Another architecture (learned positions, fused c_attn, tied head) through the same exporter."""
    model = tiny("gpt2")
    layout = export_decoder(model, tmp_path / "gpt2", max_batch=2, max_sequence=16, max_past=32)
    ort = gen.OrtRunner(tmp_path / "gpt2" / "model.onnx", layout, threads=1)
    expected = gen.greedy(gen.EagerRunner(model, layout, threads=1), layout, PROMPT, 8).tokens
    np.testing.assert_array_equal(gen.greedy(ort, layout, PROMPT, 8).tokens, expected)


def test_sliding_window_decoder_past_its_window(tmp_path):
    """Gemma 3's sliding-window layers (window 4 here, generation to 18 tokens): the export takes a past longer
    than the window (torch.export refused it when the wrapper's cache capped those layers at window - 1), and
    eager's cache, continued from step to step, gives the tokens of the model run without a cache (rebuilt from
    the arrays at each step, it had lost the tokens seen and drifted past the window)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                  sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    layout = export_decoder(model, tmp_path / "gemma3", max_batch=2, max_sequence=16, max_past=32)
    ids = PROMPT
    with torch.no_grad():  # greedy without any cache: the whole sequence again at each step
        for _ in range(12):
            logits = model(input_ids=torch.from_numpy(ids)).logits[:, -1]
            ids = np.concatenate([ids, logits.argmax(-1, keepdim=True).numpy()], axis=1)
    expected = ids[:, PROMPT.shape[1]:]
    np.testing.assert_array_equal(gen.greedy(gen.EagerRunner(model, layout, threads=1), layout, PROMPT, 12).tokens, expected)
    ort = gen.OrtRunner(tmp_path / "gemma3" / "model.onnx", layout, threads=1)
    np.testing.assert_array_equal(gen.greedy(ort, layout, PROMPT, 12).tokens, expected)


def test_openvino_runs_the_same_graph(exported):
    model, layout, artifact, _ = exported
    reference = gen.greedy(gen.EagerRunner(model, layout, threads=1), layout, PROMPT, 8)
    ov = gen.OpenVinoRunner(artifact.path, layout, threads=1)
    np.testing.assert_array_equal(gen.greedy(ov, layout, PROMPT, 8).tokens, reference.tokens)


def test_int4_weight_only_decoder_generates(exported, tmp_path):
    """weight_only on the KV graph: every projection becomes MatMulNBits, generation still runs, and
    the teacher-forced agreement is measured (random weights: near-uniform logits, so it is not a
    quality figure; the real-weights figure is bench/llm.py's)."""
    from helpers_passes import context, graph_recipe
    from optpipe.execution.stage_runner import run_checked
    from optpipe.passes import get_pass

    model, layout, artifact, _ = exported
    cls = get_pass("weight_only")
    recipe = graph_recipe([{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}],
                          {"batch": {"min": 1, "opt": 1, "max": 4}, "sequence": {"min": 1, "opt": 8, "max": 32}})
    out = run_checked(cls(cls.Params(bits=4, block_size=32)), artifact, context(recipe, tmp_path / "int4", {}))
    assert out.info["quantized"] >= 2 * 4  # at least the attention and MLP projections of both layers
    assert out.info["coverage"]["weights"]["int4"] > 0.7  # all but the embedding table (Gather) and the norms
    ort = gen.OrtRunner(out.path, layout, threads=1)
    reference = gen.greedy(gen.EagerRunner(model, layout, threads=1), layout, PROMPT, 8)
    assert 0.0 <= gen.forced_agreement(ort, layout, PROMPT, reference.tokens) <= 1.0
    assert np.isfinite(gen.perplexity(ort, layout, PROMPT[:1]))


def test_prompt_longer_than_the_export_is_one_line(exported):
    model, layout, artifact, _ = exported
    ort = gen.OrtRunner(artifact.path, layout, threads=1)
    with pytest.raises(UserInputError, match="max_sequence >= 40"):
        gen.greedy(ort, layout, np.zeros((1, 40), np.int64), 4)
    with pytest.raises(UserInputError, match="max past length"):
        gen.greedy(ort, layout, PROMPT, 70)
    with pytest.raises(UserInputError, match="max batch 4"):
        gen.greedy(ort, layout, np.zeros((6, 4), np.int64), 2)


def test_nan_logits_end_in_one_line(exported, tmp_path):
    """A stage whose weights hold a NaN (a broken quantization) fails generation naming the fix."""
    _, layout, artifact, _ = exported
    proto = artifact.load()
    weights = {t.name: t for t in proto.graph.initializer}
    head = next(weights[n.input[1]] for n in reversed(proto.graph.node) if n.op_type == "MatMul" and n.input[1] in weights)
    array = numpy_helper.to_array(head).copy()
    array[:, 3] = np.nan  # one vocabulary entry's logit: the rest of the row still looks fine
    head.CopyFrom(numpy_helper.from_array(array, head.name))
    broken = save_model(proto, tmp_path / "broken")
    with pytest.raises(gen.GenerationError, match="not finite.*exclude"):
        gen.greedy(gen.OrtRunner(broken.path, layout, threads=1), layout, PROMPT, 4)


@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_nll_in_row_blocks_equals_the_whole_window_log_softmax(rows):
    """Perplexity's log-likelihood, taken NLL_ROWS rows at a time (memory), is the whole window's float64
    log-softmax: for window lengths under, at and across the block size, and logits far from zero."""
    rng = np.random.default_rng(rows)
    logits = (rng.normal(size=(rows, 4099)) * 30 + 200).astype(np.float32)
    targets = rng.integers(0, 4099, size=rows)
    scores = logits.astype(np.float64)
    scores -= scores.max(-1, keepdims=True)
    whole = -(scores - np.log(np.exp(scores).sum(-1, keepdims=True)))[np.arange(rows), targets].sum()
    assert gen._nll(logits, targets) == pytest.approx(whole, rel=1e-12)
    logits[rows // 2, 3] = np.nan
    assert not np.isfinite(gen._nll(logits, targets))


def test_the_kv_cache_goes_by_the_keyword_the_installed_transformers_takes():
    """transformers 5.x renamed forward's `past_key_values` to `cache` (5.25 warns, 5.40 drops the old name); optpipe
    hands the cache by whichever name the model's forward takes, and reads the result's cache under either name."""
    from types import SimpleNamespace

    from optpipe.source.decoder_export import cache_keyword, cache_of

    class Old:
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            pass

    class New:
        def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None, **kwargs):
            pass

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    assert cache_of(SimpleNamespace(cache="new")) == "new"
    assert cache_of(SimpleNamespace(past_key_values="old")) == "old"
