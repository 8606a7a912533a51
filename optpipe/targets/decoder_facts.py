"""What the GenAI runtimes' folders need from the recipe's model beyond the graph: the generation
config (eos/bos/pad ids), the Hugging Face config (hidden size, heads, model type) and the local
tokenizer folder, read from the recipe's hf folder or hf_config (offline)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optpipe.core.errors import OptpipeError


def generation_config(source) -> dict[str, Any]:
    """The model's generation_config.json (its hf folder's, else the eos/bos/pad ids of its config)."""
    folder = hf_folder_of(source)
    if folder is not None and (folder / "generation_config.json").is_file():
        return json.loads((folder / "generation_config.json").read_text())
    config = hf_config(source, folder)
    ids = {key: getattr(config, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")} if config else {}
    return {key: value for key, value in ids.items() if value is not None}


def hf_folder_of(source) -> Path | None:
    from optpipe.recipe.model_specs import HFModel
    from optpipe.source.model_source import hf_folder

    try:
        return hf_folder(source) if source is not None and isinstance(source.model, HFModel) else None
    except OptpipeError:
        return None


def hf_config(source, folder: Path | None):
    from optpipe.recipe.model_specs import HFConfigModel

    try:
        import transformers

        if folder is not None:
            return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if source is not None and isinstance(source.model, HFConfigModel):
            options = dict(source.model.hf_config)
            return transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    except (OSError, ValueError, KeyError):
        return None
    return None


def eos(config: dict[str, Any]) -> int | None:
    """The first eos token id of a generation config (HF allows a list), or None."""
    value = config.get("eos_token_id")
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def tokenizer_folder(source) -> Path | None:
    """The recipe's local Hugging Face tokenizer folder (hf folder, or hf_config's tokenizer), or None."""
    from optpipe.source.prompts import _tokenizer_folder

    try:
        return _tokenizer_folder(source) if source is not None else None
    except OptpipeError:
        return None  # a folder without config.json: no Hugging Face tokenizer to convert either
