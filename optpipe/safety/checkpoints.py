"""Load weights into a factory-built module without running code from the file.

`.safetensors` files hold only tensors. A `torch.save` file is a pickle: it is
loaded with `weights_only=True` (plain tensors and containers, no arbitrary
objects) unless the recipe says `allow_pickle: true` for a file it trusts.
"""
from __future__ import annotations

import logging

from pathlib import Path
from typing import Any

from optpipe.core.errors import ModelSourceError, first_line

log = logging.getLogger("optpipe.source")

STATE_KEYS = ("state_dict", "model_state_dict", "model")


def load_checkpoint(module: Any, path: Path, allow_pickle: bool) -> None:
    """Load `path` into `module` (strict: every key must match), or say what to change."""
    if not path.is_file():
        raise ModelSourceError(f"model.checkpoint: file '{path}' does not exist; fix the path")
    state = _read(path, allow_pickle)
    state = _unwrap(state)
    if not isinstance(state, dict):
        raise ModelSourceError(f"model.checkpoint: '{path.name}' holds a {type(state).__name__}, not a state dict of tensors; save module.state_dict()")
    state = _without_wrapper_prefix(state, set(module.state_dict()), path.name)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines()[1:] if line.strip())[:200]
        raise ModelSourceError(
            f"model.checkpoint: '{path.name}' does not fit the factory's module ({detail or first_line(exc)}); "
            "check the factory's kwargs or the checkpoint"
        ) from None


def _read(path: Path, allow_pickle: bool) -> Any:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelSourceError(f"model.checkpoint: '{path.name}' is not a valid safetensors file ({first_line(exc)})") from None
    import pickle

    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        if allow_pickle or "global" not in str(exc).lower():  # no object (GLOBAL) refused: a broken file
            raise ModelSourceError(f"model.checkpoint: '{path.name}' is not a readable torch checkpoint ({_unpickler_reason(exc)[:160]})") from None
        raise ModelSourceError(
            f"model.checkpoint: '{path.name}' holds pickled Python objects beyond tensors, which could run code; "
            "save it as .safetensors, or set `model.allow_pickle: true` if you trust the file"
        ) from None
    except Exception as exc:  # truncated or not a torch file
        raise ModelSourceError(f"model.checkpoint: '{path.name}' is not a readable torch checkpoint ({first_line(exc)[:160]})") from None


def _unpickler_reason(exc: Exception) -> str:
    """torch's weights-only unpickler puts the reason ("Unsupported operand 110") after a paragraph
    about PyTorch 2.6's defaults that says nothing about this file."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = next((line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()), "")
        if reason:
            return f"{reason}: not a torch.save file, or a damaged one"
    return first_line(exc)


def _unwrap(state: Any) -> Any:
    """Training scripts often save {'state_dict': ..., 'epoch': ...}: take the weights. A whole module saved with
    torch.save(model) (read only under allow_pickle) gives its state dict."""
    if hasattr(state, "state_dict") and callable(state.state_dict) and not isinstance(state, dict):
        return state.state_dict()
    if isinstance(state, dict):
        for key in STATE_KEYS:
            if isinstance(state.get(key), dict):
                return state[key]
    return state


#: the prefixes a training wrapper puts before every key: DataParallel / DistributedDataParallel ("module."),
#: torch.compile ("_orig_mod."), a Lightning module holding the net as `self.model` ("model."), nested as they come
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")


def _without_wrapper_prefix(state: dict, expected: set[str], name: str) -> dict:
    """The state dict with the training wrappers' key prefixes dropped, where that makes its keys exactly the module's;
    else as it is (the strict load then names the keys that differ). Written here because torch's
    consume_prefix_in_state_dict_if_present takes one known prefix and changes the dict in place."""
    keys = set(state)
    stripped = state
    while keys != expected:
        prefix = next((p for p in WRAPPER_PREFIXES if keys and all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            return state
        stripped = {k[len(prefix):]: v for k, v in stripped.items()}
        keys = set(stripped)
    if stripped is not state:
        log.info("model.checkpoint: '%s' keys carry a training wrapper's prefix (DataParallel's module., torch.compile's "
                 "_orig_mod., Lightning's model.): dropped, every key then fits the module", name)
    return stripped
