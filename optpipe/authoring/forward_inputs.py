"""Every input of a model's forward(), for `optpipe init`: read from its signature, sized from its
config and named as its tokenizer/processor names them; or a one-line refusal naming the input
that could not be inferred.

Why the signature: a one-input guess wrote a one-input recipe for CLIP (pixel_values + input_ids),
called it valid and left the user a note; the signature lists every input, and the names that
are not known (below) and have no default are exactly what init cannot fill in by itself.
"""
from __future__ import annotations

from typing import Any, Optional

from optpipe.core.errors import ModelSourceError
from optpipe.core.runtime import DECODER_IDS

TEXT = ("input_ids", "attention_mask", "token_type_ids")
IMAGE = "pixel_values"
AUDIO = "input_values"
MEL = "input_features"  # Whisper's log-mel spectrogram: num_mel_bins x 2 * max_source_positions frames, fixed
KNOWN = (*TEXT, IMAGE, AUDIO, MEL, DECODER_IDS)


def unknown_required(params: list[tuple[str, bool]], known: set[str], owner: str, inferred: list[dict] | None = None) -> None:
    """Refuse, naming it, the first required input init cannot infer. `inferred`: a plain module's one input, read from
    its first layer (no config sizes the others): said, to copy into the `inputs` written by hand."""
    missing = next((name for name, required in params if required and name not in known), None)
    if missing is None:
        return
    if inferred is not None:
        import yaml

        shown = ", ".join(yaml.safe_dump(spec, default_flow_style=True, sort_keys=False).strip() for spec in inferred)
        raise ModelSourceError(f"init: cannot infer input '{missing}' of {owner}.forward(): a plain module's first layer "
                               f"tells its first input only ({shown}); write `inputs` by hand with both")
    raise ModelSourceError(f"init: cannot infer input '{missing}' of {owner}.forward() (its shape and dtype are not in "
                           f"the config); write `inputs` for it by hand, known names: {', '.join(KNOWN)}")


def hf_inputs(params: list[tuple[str, bool]], config: dict, tokenizer_names: Optional[list[str]], owner: str, net=None
              ) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """The inputs of a Hugging Face model's forward() that its config can size: token ids (and the
    tokenizer's masks), images, raw audio; refuses a required one it cannot. `net` (the model, on the meta device
    or not): the sequence it takes, where its position table says less than its config (fit_positions)."""
    names = [name for name, _ in params]
    text_config = config.get("text_config") or config
    vision_config = config.get("vision_config") or config
    inputs: list[dict[str, Any]] = []
    dims = {"batch": {"min": 1, "opt": 1, "max": 16}}
    known: set[str] = set()
    if IMAGE in names and ("image_size" in vision_config or "num_channels" in vision_config):
        size = vision_config.get("image_size", 224)
        height, width = (size, size) if isinstance(size, int) else (size[0], size[-1])  # [height, width]: not square
        inputs.append(input_entry(IMAGE, "float32", ["batch", vision_config.get("num_channels", 3), height, width]))
        known.add(IMAGE)
    if "input_ids" in names and "vocab_size" in text_config:
        vocab = int(text_config["vocab_size"])
        longest = int(text_config.get("max_position_embeddings", text_config.get("n_positions", 512)))
        wanted = tokenizer_names or ["input_ids", "attention_mask"]
        for name in [n for n in TEXT if n in names and (n == "input_ids" or n in wanted)]:
            inputs.append(input_entry(name, "int64", ["batch", "sequence"], **({"range": [0, vocab]} if name == "input_ids" else {})))
            known.add(name)
        dims["sequence"] = {"min": 1, "opt": min(128, longest), "max": min(512, longest)}
    if AUDIO in names and not known and "num_mel_bins" in config and "max_length" in config:
        # The Audio Spectrogram Transformer's input_values are filterbank frames, not samples: its patch grid is
        # built for max_length frames of num_mel_bins (its position embeddings take no other size)
        inputs.append(input_entry(AUDIO, "float32", ["batch", int(config["max_length"]), int(config["num_mel_bins"])]))
        known.add(AUDIO)
    elif AUDIO in names and not known:
        inputs.append(input_entry(AUDIO, "float32", ["batch", "samples"]))
        dims["samples"] = {"min": 1600, "opt": 16000, "max": 160000}
        known.add(AUDIO)
    if MEL in names and not known and "num_mel_bins" in config and "max_source_positions" in config:
        # The encoder refuses any other length (its positions are 2 frames each, after a stride-2 conv)
        inputs.append(input_entry(MEL, "float32", ["batch", int(config["num_mel_bins"]), 2 * int(config["max_source_positions"])]))
        known.add(MEL)
    if DECODER_IDS in names and config.get("is_encoder_decoder") and "vocab_size" in text_config:
        # Optional in forward(), yet an encoder-decoder runs its decoder on them: without, T5 and BART refuse
        inputs.append(input_entry(DECODER_IDS, "int64", ["batch", "target"], range=[0, int(text_config["vocab_size"])]))
        longest = int(text_config.get("max_target_positions", text_config.get("max_position_embeddings", 512)))
        dims["target"] = {"min": 1, "opt": min(32, longest), "max": min(128, longest)}
        known.add(DECODER_IDS)
    unknown_required(params, known, owner)
    if net is not None:
        fit_positions(net, dims)
    inputs.sort(key=lambda spec: names.index(spec["name"]))  # a factory's module takes them by position
    if not inputs:
        raise ModelSourceError(f"init: cannot infer any input of {owner}.forward() ({', '.join(names[:6])}) from its config; "
                               "write `inputs` by hand")
    return inputs, dims


def fit_positions(net, dims: dict) -> None:
    """A model whose position ids start after the padding index (RoBERTa's scheme: XLM-R, MPNet, CamemBERT, Longformer
    ...) takes num_embeddings - padding_idx - 1 tokens, not its config's max_position_embeddings (514 for 512 tokens):
    at the config's length init's own run of it failed ("index out of range"). Read from the module, not a list of
    architectures: a position table with a padding index is that scheme."""
    import torch

    sequence = dims.get("sequence")
    if sequence is None:
        return
    for name, module in net.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            usable = module.num_embeddings - module.padding_idx - 1
            sequence["max"] = max(1, min(sequence["max"], usable))
            sequence["opt"] = max(1, min(sequence["opt"], usable))


def task_layout(task: str, inputs: list[dict[str, Any]], dims: dict, config: dict) -> None:
    """The heads whose inputs have one more axis than their encoder's: a multiple-choice model takes every choice's
    tokens ([batch, choices, sequence]), a video classifier a clip of frames ([batch, frames, channels, size, size])."""
    for spec in inputs:
        if task == "multiple-choice" and spec["shape"] == ["batch", "sequence"]:
            spec["shape"] = ["batch", "choices", "sequence"]
            dims["choices"] = {"min": 2, "opt": 4, "max": 8}
        elif task == "video-classification" and spec["name"] == IMAGE and len(spec["shape"]) == 4:
            spec["shape"] = ["batch", int(config.get("num_frames", 16)), *spec["shape"][1:]]


def input_entry(name: str, dtype: str, shape: list, **extra) -> dict[str, Any]:
    """One recipe input; a mask is filled with ones and token types with zeros, as tokenizers make them."""
    entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": shape}
    if name == "attention_mask":
        entry["fill"] = 1
    elif name == "token_type_ids":
        entry["fill"] = 0
    entry.update(extra)
    return entry


def meta_tensors(inputs: list[dict[str, Any]], dims: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Tensors on the meta device at the `opt` shape: forward() runs for its shapes and op counts only."""
    import torch

    tensors = {}
    for spec in inputs:
        shape = [d if isinstance(d, int) else dims[d]["opt"] for d in spec["shape"]]
        tensors[spec["name"]] = torch.zeros(shape, dtype=getattr(torch, spec["dtype"]), device="meta")
    return tensors


def real_tensors(inputs: list[dict], dims: dict) -> dict:
    """Tensors at the `opt` shape: ids within their range, masks at their fill, floats N(0, 1)."""
    import numpy as np
    import torch

    tensors = {}
    for spec in inputs:
        shape = [d if isinstance(d, int) else dims[d]["opt"] for d in spec["shape"]]
        if spec["dtype"].startswith("int"):
            high = (spec.get("range") or [0, 2])[1]
            tensors[spec["name"]] = torch.from_numpy(np.random.default_rng(0).integers(0, high, shape)).to(getattr(torch, spec["dtype"]))
        else:
            tensors[spec["name"]] = torch.from_numpy(np.random.default_rng(0).normal(size=shape).astype(np.float32))
        if "fill" in spec:
            tensors[spec["name"]] = torch.full(shape, spec["fill"], dtype=getattr(torch, spec["dtype"]))
    return tensors
