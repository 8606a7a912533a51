"""A PyTorch / Hugging Face source's FP32 weight bytes, known before anything loads: the memory
preflight's input for torch sources (safety/memory_estimate.py's factors then give each stage's peak).

- an `hf` folder (or package): the safetensors files' headers (tensor shapes, read without the data
  through safetensors' own `safe_open`); a folder with only a config (or .bin weights): the
  architecture built from config.json on the `meta` device (no memory behind its parameters);
- `hf_config`: the same meta-device build from the recipe's config;
- a factory with a .safetensors checkpoint: that file's header. Other factories and torchvision
  models run user code or build the model to know their size: no estimate (the run goes on, as before).
Counted as FP32 (4 bytes a parameter): the passes' copies are FP32 whatever the checkpoint's dtype.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from optpipe.recipe.schema import FactoryModel, HFConfigModel, HFModel, ModelSource

log = logging.getLogger("optpipe.safety")
FP32 = 4
#: A torch model this big is dropped once no stage left needs it, and loaded again for the eager
#: rows (execution/services.py). BERT-base (438 MB) held under every pass after its export was 0.44 GB
#: on each of their peaks (docs/memory.md); its reload from the seeded config costs a few seconds.
#: Below this (MiniLM, 90 MB) the reload is not worth its time.
RELEASE_BYTES = 256 << 20


def held_beside_passes(fp32_bytes: int) -> int:
    """What a run keeps resident beside every pass after the export: a model under RELEASE_BYTES, held for
    the eager rows; nothing for a bigger one, dropped after the export (its dynamo export runs in a worker of
    its own, passes/export.py) and loaded again for the eager rows. The memory preflight's `held`."""
    return fp32_bytes if fp32_bytes < RELEASE_BYTES else 0


def fp32_weight_bytes(source: ModelSource) -> int | None:
    """None where the source cannot tell its size without running: no estimate. A broken file or config
    is no estimate either: loading the model names the real problem in its own line, as before."""
    try:
        return _weight_bytes(source)
    except Exception:  # noqa: BLE001 - an estimate only (a garbage safetensors header, a config that is not JSON)
        log.debug("no weight estimate for this source", exc_info=True)
        return None


def _weight_bytes(source: ModelSource) -> int | None:
    spec = source.model
    if isinstance(spec, HFModel):
        from optpipe.source.model_source import hf_folder

        folder = hf_folder(source)
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return FP32 * sum(safetensors_parameters(f) for f in files)
    if isinstance(spec, (HFModel, HFConfigModel)):
        options = config_options(source)
        return _meta_bytes(options.pop("model_type", None), options, spec.task)
    if isinstance(spec, FactoryModel) and spec.checkpoint and spec.checkpoint.endswith(".safetensors"):
        return FP32 * safetensors_parameters(source.resolve(spec.checkpoint))
    return None


def safetensors_parameters(path: Path) -> int:
    """Parameters in a .safetensors file, from its header (shapes) alone."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="numpy") as handle:
        for name in handle.keys():
            count = 1
            for dim in handle.get_slice(name).get_shape():
                count *= dim
            total += count
    return total


def _meta_bytes(model_type: str | None, options: dict, task: str) -> int | None:
    """The architecture built on torch's meta device: its parameter count with no memory behind it."""
    import torch
    import transformers

    from optpipe.source.model_source import HF_AUTO_CLASSES

    try:
        config = transformers.AutoConfig.for_model(model_type, **options)
        with torch.device("meta"):
            model = getattr(transformers, HF_AUTO_CLASSES[task]).from_config(config)
    except Exception:  # noqa: BLE001 - an estimate only: loading the model names the real problem later
        log.debug("no weight estimate for this config", exc_info=True)
        return None
    return FP32 * sum(p.numel() for p in model.parameters())


#: the tasks whose Auto class has an LM head, the only head that shares the embedding table
LM_HEAD_TASKS = frozenset({"causal-lm", "text-generation", "fill-mask", "masked-lm"})


def tied_table_bytes(source: ModelSource) -> int:
    """The FP32 bytes of an embedding table the LM head shares (tie_word_embeddings), else 0: weight_only with
    HQQ writes that table transposed for the head (optpipe/graph/matmul_weights.py), a transient the memory
    preflight adds. From the config alone: a folder's config.json or the recipe's hf_config, with the model
    type's defaults (transformers' AutoConfig)."""
    try:
        return _tied_bytes(source)
    except Exception:  # noqa: BLE001 - an estimate only
        log.debug("no tied-embedding estimate for this source", exc_info=True)
        return 0


def _tied_bytes(source: ModelSource) -> int:
    import transformers

    if not isinstance(source.model, (HFModel, HFConfigModel)) or source.model.task not in LM_HEAD_TASKS:
        return 0  # no LM head to share the table: a BERT's config says tied (transformers' default) all the same
    options = config_options(source)
    config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    text = config.get_text_config()
    if not getattr(config, "tie_word_embeddings", False) and not getattr(text, "tie_word_embeddings", False):
        return 0
    return FP32 * int(text.vocab_size) * int(text.hidden_size)


def config_options(source: ModelSource) -> dict:
    """The config's keys, model_type included: the recipe's hf_config (a copy), else the config.json of the model's
    Hugging Face folder (an ONNX source's: of its tokenizer's folder, as an Optimum export writes them)."""
    spec = source.model
    if isinstance(spec, HFConfigModel):
        return dict(spec.hf_config)
    from optpipe.source.model_source import hf_folder

    return json.loads((hf_folder(source) / "config.json").read_text())
