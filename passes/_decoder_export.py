"""The export pass for a decoder measured by generation (evaluate.generation): the Hugging Face
causal LM exported with its KV cache (optpipe/source/decoder_export.py), checked against PyTorch
eager with its own cache on a short greedy generation. Imported by passes/export.py; the pass
registry skips modules whose names start with an underscore.

The check is a generation, not the one-forward self-check alone: a graph whose prefill matches eager
but whose cache is wired wrong (presents shifted, a layer's key and value swapped) would pass a
one-forward check and generate garbage.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from optpipe.core.artifact import ModelArtifact, adopt_model, write_info
from optpipe.core.errors import PassError
from optpipe.recipe.generation_spec import decoder_dims

CHECK_TOKENS = 4


def export_with_cache(torch_model, ctx, steps, check_atol: float | None, opset: int = 20,
                      attention: str | None = None) -> ModelArtifact:
    """The causal LM's graph with its KV cache, checked by greedy generation against eager; `steps`: the export's
    progress lines (torch.export of a 270M decoder runs for minutes with no hook inside)."""
    from optpipe.graph.stats import graph_stats
    from optpipe.source.decoder_export import export_decoder, hf_causal_lm

    model = hf_causal_lm(torch_model)
    max_batch, max_sequence, max_past = decoder_dims(ctx.evaluate.generation, ctx.inputs.inputs, ctx.inputs.dims,
                                                     ctx.evaluate.task.tokens)
    raw = ctx.workdir / "raw-decoder"
    if opset < 18:
        ctx.log.warning("the decoder with its KV cache is exported at opset 18 (asked: %d): the dynamo exporter's minimum", opset)
    steps("torch.onnx dynamo export with the KV cache")
    layout = export_decoder(model, raw, max_batch=max_batch, max_sequence=max_sequence, max_past=max_past,
                            opset=max(opset, 18))  # the dynamo exporter's minimum: the cache wrapper needs dynamo
    steps("greedy generation against eager")
    check = _generation_check(raw / "model.onnx", model, layout, ctx.evaluate.threads, check_atol)
    steps("save the model")
    artifact = adopt_model(raw / "model.onnx", ctx.workdir)  # renamed into place: the weights are not read again
    _remove_tree(raw)
    info = {"exporter": layout.exporter, "opset": max(opset, 18), "opset_requested": opset, "attention": attention,
            "exporter_requested": "decoder with KV cache (evaluate.generation)",
            "kv_cache": layout.to_dict(), "source": torch_model.description, "outputs": ["logits", *layout.present_names],
            "generation_check": check, "graph": graph_stats(artifact.load(with_weights=False))}
    return write_info(ctx.workdir, info)


def _generation_check(path: Path, model, layout, threads: int, check_atol: float | None) -> dict:
    """Greedy tokens of the exported graph (ONNX Runtime) equal eager's, and the logits' largest difference."""
    from optpipe.evaluation import generation as gen

    rows = min(2, layout.max_batch)  # a recipe whose batch max is 1 is checked at batch 1
    prompt = (np.arange(rows * 3, dtype=np.int64).reshape(rows, 3) * 7 + 1) % layout.vocab
    onnx_runner, eager = gen.OrtRunner(path, layout, threads), gen.EagerRunner(model, layout, threads)
    mask = np.ones(prompt.shape, np.int64)
    logits, _ = onnx_runner.forward(prompt, mask, gen.empty_past(layout, rows))
    expected, _ = eager.forward(prompt, mask, gen.empty_past(layout, rows))
    max_abs = float(np.abs(logits - expected).max())
    tokens = gen.greedy(onnx_runner, layout, prompt, CHECK_TOKENS).tokens
    eager_tokens = gen.greedy(eager, layout, prompt, CHECK_TOKENS).tokens
    onnx_runner.close()
    same = float((tokens == eager_tokens).mean())
    if same < 1.0 or (check_atol is not None and max_abs > check_atol):
        raise PassError(f"the KV-cache export does not generate as eager does: {same:.0%} of {CHECK_TOKENS} greedy tokens "
                        f"equal, prefill logits differ by up to {max_abs:.2e}; report this model (the exporter's cache "
                        "wiring does not fit it)")
    return {"against": "eager with DynamicCache", "tokens": int(tokens.size), "same_tokens": same, "prefill_max_abs": max_abs}


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
