"""The export pass for a decoder measured by generation (evaluate.generation): the Hugging Face
causal LM exported with its KV cache (optpipe/source/decoder_export.py). Imported by passes/export.py;
the pass registry skips modules whose names start with an underscore.

The check against PyTorch eager is a short greedy generation (optpipe/evaluation/generation_check.py),
run by the stage's self-check after the pass. Eager's half of it, and eager's outputs for the one-forward
check, are taken here before the export and handed over: the export's worker (a big model's) then never
holds an ONNX Runtime session beside the torch model, and the compile's process never loads the model for
the check (1.1 B: the worker peaked at 2.20x the FP32 weights holding both; docs/memory.md).
"""
from __future__ import annotations

import shutil

from optpipe.core.artifact import ModelArtifact, adopt_model, write_info
from optpipe.recipe.generation_spec import decoder_dims


def export_with_cache(torch_model, ctx, steps, eager: tuple, opset: int = 20, attention: str | None = None) -> ModelArtifact:
    """The causal LM's graph with its KV cache; `steps`: the export's progress lines (torch.export of a 270M
    decoder runs for minutes with no hook inside); `eager`: (feeds, outputs) of PyTorch eager on the trace
    inputs, handed to the self-check with the greedy tokens."""
    from optpipe.evaluation.generation_check import eager_reference
    from optpipe.evaluation.self_check import hand_over_eager
    from optpipe.graph.stats import graph_stats
    from optpipe.source.decoder_export import export_decoder, hf_causal_lm, layout_of

    model = hf_causal_lm(torch_model)
    max_batch, max_sequence, max_past = decoder_dims(ctx.evaluate.generation, ctx.inputs.inputs, ctx.inputs.dims,
                                                     ctx.evaluate.task.tokens)
    steps("PyTorch eager: greedy tokens for the self-check")
    hand_over_eager(ctx.workdir, *eager, eager_reference(model, layout_of(model, max_batch, max_sequence, max_past),
                                                         ctx.evaluate.threads))
    raw = ctx.workdir / "raw-decoder"
    if opset < 18:
        ctx.log.warning("the decoder with its KV cache is exported at opset 18 (asked: %d): the dynamo exporter's minimum", opset)
    steps("torch.onnx dynamo export with the KV cache")
    layout = export_decoder(model, raw, max_batch=max_batch, max_sequence=max_sequence, max_past=max_past,
                            opset=max(opset, 18))  # the dynamo exporter's minimum: the cache wrapper needs dynamo
    steps("save the model")
    artifact = adopt_model(raw / "model.onnx", ctx.workdir)  # renamed into place: the weights are not read again
    shutil.rmtree(raw, ignore_errors=True)
    info = {"exporter": layout.exporter, "opset": max(opset, 18), "opset_requested": opset, "attention": attention,
            "exporter_requested": "decoder with KV cache (evaluate.generation)",
            "kv_cache": layout.to_dict(), "source": torch_model.description, "outputs": ["logits", *layout.present_names],
            "graph": graph_stats(artifact.load(with_weights=False)),
            **({"source_warnings": torch_model.warnings} if torch_model.warnings else {})}
    return write_info(ctx.workdir, info)
