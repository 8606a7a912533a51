"""Forward outputs of any structure -> a flat, named tuple of tensors, which exporters and runners want.

A model may return a tensor, a tuple/list, a dict, a dataclass or a transformers `ModelOutput`
(nested any way). Leaves are named by their path: a dict/dataclass field by its key, a sequence
item by its index (`logits`, `past_key_values.0.1`, `output_1`). Leaves that are not tensors
(None, a transformers Cache object, ints) are left out. Written by hand because neither torch nor
transformers exposes named flattening: torch.utils._pytree is private and names nothing.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

from optpipe.core.errors import ModelSourceError


def named_leaves(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, tensor) for every tensor leaf of `value`, in a stable order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [(prefix or "output", value)]
    if isinstance(value, Mapping) or _is_model_output(value):
        items = list(value.items())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: its fields name it, as a dataclass's do
        items = [(name, getattr(value, name)) for name in value._fields]
    elif isinstance(value, (tuple, list)):
        items = [(str(i), item) for i, item in enumerate(value)]
        if not prefix:
            items = [(f"output_{i}", item) for i, item in enumerate(value)]
    else:
        return []  # None, Cache objects, Python numbers: not outputs an exporter can name
    leaves = []
    for key, item in items:
        leaves += named_leaves(item, f"{prefix}.{key}" if prefix else str(key))
    return leaves


def _is_model_output(value: Any) -> bool:
    # transformers' ModelOutput is an OrderedDict subclass that holds only the fields that are set
    return type(value).__name__.endswith("Output") and hasattr(value, "items")


def pick_outputs(available: list[str], wanted: list[str] | None, declared: list[str] | None) -> tuple[list[int], list[str]]:
    """Which leaves to export (their indices) and their names.

    declared: the module's own `output_names` attribute, which names the leaves in order when the
    counts match; wanted: the recipe's `model.outputs`, a choice among those names."""
    if not available:
        raise ModelSourceError("model: forward() returned no tensors; return a tensor, a tuple/dict of tensors or a ModelOutput")
    names = list(declared) if declared and len(declared) == len(available) else available
    if not wanted:
        return list(range(len(names))), names
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ModelSourceError(
            f"model.outputs: the model has no output {', '.join(repr(m) for m in missing)}; its outputs are {', '.join(names)}"
        )
    return [names.index(name) for name in wanted], list(wanted)


def flat_module(model, call: Callable[..., Any], indices: list[int]):
    """A torch module around `model` whose forward takes the recipe's inputs positionally and returns
    the chosen tensor leaves as a tuple. `call(model, *args)` runs the model (positional or by keyword)."""
    import torch

    class FlatOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            leaves = named_leaves(call(self.model, *args))
            return tuple(leaves[i][1] for i in indices)

    return FlatOutputs()
