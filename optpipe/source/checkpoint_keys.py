"""The weights a Hugging Face checkpoint and the Auto class that loads it do not share (transformers' loading info).

Loading a folder as another head than its own is silent in transformers but for a console table: a BertForPreTraining
checkpoint compiled as `task: feature-extraction` left its heads out, and a base checkpoint compiled as
`sequence-classification` got a classifier initialized at random, whose outputs every stage then matched faithfully."""
from __future__ import annotations

SHOWN = 3


def loading_warnings(info: dict, class_name: str, task: str, architecture: str) -> list[str]:
    """One warning per kind of weight the two do not share: made up at random, or left out."""
    head = f"set `model.task` to the head the folder was saved with (its config's architecture: {architecture or 'none named'})"
    warnings = []
    made_up = sorted({_key(k) for k in info.get("missing_keys") or []} | {_key(k) for k in info.get("mismatched_keys") or []})
    if made_up:
        warnings.append(f"{class_name} (`task: {task}`) has {len(made_up)} weights the checkpoint lacks or holds in another shape, "
                        f"initialized at random by transformers ({_names(made_up)}): what is computed from them is random, "
                        f"not the checkpoint's model; {head}")
    left_out = sorted({_key(k) for k in info.get("unexpected_keys") or []})
    if left_out:
        warnings.append(f"the checkpoint holds {len(left_out)} weights that {class_name} (`task: {task}`) does not use "
                        f"({_names(left_out)}): the compiled model leaves them out; {head} if that is the model you deploy")
    return warnings


def _key(entry) -> str:
    return entry if isinstance(entry, str) else str(entry[0])  # mismatched keys come with their two shapes


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
