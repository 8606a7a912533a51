"""The KV-cache layout of a stage's model, read from its graph's inputs (a generation evaluation's).

The layout comes from each stage's own graph, not from the export's info: a weight-only or OpenVINO
stage keeps the inputs, and a graph without them (an ONNX source exported without its cache) is named.
The prompts and text are optpipe/source/prompts.py's.
"""
from __future__ import annotations

from pathlib import Path

from optpipe.core.errors import UserInputError
from optpipe.core.runtime import PAST_PREFIX
from optpipe.recipe.generation_spec import decoder_dims
from optpipe.recipe.schema import EvaluateSpec, ModelSource
from optpipe.source.prompts import Texts, batch_prompt, texts, weights_kind  # noqa: F401  (generation_eval's)
from optpipe.source.decoder_export import DecoderLayout


def logits_vocab(path: Path, is_ir: bool) -> int | None:
    """The vocabulary: the logits output's last dim, where the graph fixes it."""
    if is_ir:
        from optpipe.evaluation.openvino_runtime import read_model

        for port in read_model(path).outputs:
            if "logits" in port.get_names() and port.get_partial_shape()[-1].is_static:
                return port.get_partial_shape()[-1].get_length()
        return None
    import onnx

    for value in onnx.load(str(path), load_external_data=False).graph.output:
        if value.name == "logits" and value.type.tensor_type.shape.dim[-1].HasField("dim_value"):
            return value.type.tensor_type.shape.dim[-1].dim_value
    return None


def layout_of_stage(path: Path, is_ir: bool, evaluate: EvaluateSpec, source: ModelSource, stage: str) -> DecoderLayout:
    """The KV-cache layout of a stage's graph (its past_key_values.<i>.key/value inputs), with the recipe's dims."""
    shapes = graph_inputs(path, is_ir)
    pasts = {name: shape for name, shape in shapes.items() if name.startswith(PAST_PREFIX)}
    if not pasts:
        raise UserInputError(
            f"evaluate.generation: stage '{stage}' has no past_key_values inputs (its model was not exported with a KV "
            f"cache; inputs: {', '.join(shapes) or 'none'}); export from the Hugging Face causal LM (model.hf with task: "
            "causal-lm), or an ONNX decoder with past_key_values.<i>.key/value inputs, or remove evaluate.generation")
    first = pasts.get(f"{PAST_PREFIX}0.key") or next(iter(pasts.values()))
    if len(first) != 4 or not all(isinstance(d, int) for d in (first[1], first[3])):
        raise UserInputError(f"evaluate.generation: stage '{stage}': past_key_values inputs must be [batch, kv_heads, "
                             f"past, head_dim] with fixed kv_heads and head_dim, got {first}")
    max_batch, max_sequence, max_past = decoder_dims(evaluate.generation, source.inputs, source.dims, evaluate.task.tokens)
    return DecoderLayout(layers=len(pasts) // 2, kv_heads=first[1], head_dim=first[3], vocab=logits_vocab(path, is_ir) or 0,
                         max_batch=max_batch, max_sequence=max_sequence, max_past=max_past)


def graph_inputs(path: Path, is_ir: bool = False) -> dict[str, list]:
    """input name -> its dims (ints, or the dim names / None where not fixed), of an ONNX file or an OpenVINO IR."""
    if is_ir:
        from optpipe.evaluation.openvino_runtime import read_model

        return {port.get_any_name(): [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
                for port in read_model(path).inputs}
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return {value.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]
            for value in graph.input}
