"""The longest sequence a model with a learned position table takes, held against the recipe's dims.

Why here and not in the export's checks: those compare the export with eager at sizes near the trace's (at most
twice it), never at a dim's max, and skip a size eager itself refuses. A recipe asking for `sequence` up to 4096
on a BERT with 512 positions exported, evaluated and deployed "ok" (the Triton config and the TensorRT profile
promise 4096), and the model fails on the first input longer than 512. A forward at the max would find it but
costs what the max costs (attention at 32k tokens does not fit); the table's size is known without running.
"""
from __future__ import annotations

from optpipe.core.errors import RecipeError
from optpipe.recipe.schema import ModelInputs

#: The names Hugging Face models give a learned absolute position table (BERT family, GPT-2, OPT, BART, Whisper...).
#: Rotary, ALiBi and relative positions have none: they take any length, so nothing is held against them.
POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")


def position_limit(module) -> tuple[str, int] | None:
    """(the table's name, the positions it serves) of the smallest learned position table, else None.

    A padding row comes first where `padding_idx` is set (RoBERTa: 514 rows, positions from 2, so 512), and OPT's
    and BART's tables keep an `offset` of 2 rows the same way."""
    import torch

    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES:
            reserved = (sub.padding_idx + 1 if sub.padding_idx is not None else 0) + int(getattr(sub, "offset", 0) or 0)
            found.append((sub.num_embeddings - reserved, name))
    if not found:
        return None
    positions, name = min(found)
    return name.removeprefix("model."), positions  # the loader's FlatOutputs holds the net as `model`


def onnx_position_limit(graph) -> tuple[str, int] | None:
    """position_limit of an ONNX graph: the smallest 2-D initializer named after a position table (an exported
    model keeps its module names: `embeddings.position_embeddings.weight`, `transformer.wpe.weight`). Its padding
    rows or offset are not known here: the rows are the bound (RoBERTa's 514 where 512 serve), lenient, never wrong."""
    import re

    found = [(tensor.dims[0], tensor.name) for tensor in graph.initializer if len(tensor.dims) == 2
             and set(re.split(r"[./:]", tensor.name)) & set(POSITION_TABLES)]
    if not found:
        return None
    rows, name = min(found)
    return name, rows


def check_sequence_dims(module, inputs: ModelInputs) -> None:
    """Each dynamic dim of an integer input (token ids, masks) after the batch within the module's position table."""
    hold_sequence_dims(position_limit(module), inputs)


def hold_sequence_dims(limit: tuple[str, int] | None, inputs: ModelInputs) -> None:
    """Each dynamic dim of an integer input after the batch within `limit` (a table's name, its positions); else one
    line naming the dim, the table and the longest length it serves."""
    if limit is None:
        return
    name, positions = limit
    dims = {dim for spec in inputs.inputs if spec.dtype.startswith(("int", "uint")) for dim in spec.shape[1:]
            if isinstance(dim, str)}
    for dim in sorted(dims):
        longest = inputs.dims[dim].max
        if longest > positions:
            raise RecipeError(f"dims.{dim}.max: {longest} is longer than the model takes: its learned position table "
                              f"({name}) has {positions} positions; set dims.{dim}.max to at most {positions}")
