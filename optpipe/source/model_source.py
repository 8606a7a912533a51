"""Load the recipe's model: a local Hugging Face folder (or one inside an installed package),
a torchvision architecture, a `module:function` factory, or an existing ONNX file.

Nothing is ever downloaded: Hugging Face loading runs with `local_files_only`.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from contextlib import contextmanager
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optpipe.core.artifact import sha256_file
from optpipe.core.errors import DataError, ModelSourceError, first_line
from optpipe.recipe.example_inputs import example_inputs
from optpipe.source.checkpoint_keys import loading_warnings
from optpipe.source.code_digest import code_digests, kwargs_files
from optpipe.source.module_forms import input_binding, load_torchscript, positional, refuse_unexportable, scripted_as_is
from optpipe.source.checkpoint_precision import (folder_config, refuse_prequantized, refuse_quantized_modules, stored_dtype,
                                                 as_float32, widening_note)
from optpipe.recipe.schema import FactoryModel, HFConfigModel, HFModel, ModelSource, OnnxModel, TorchScriptModel, TorchvisionModel


@dataclass
class TorchModel:
    """A torch module ready for export: it takes the recipe's inputs positionally and returns a tuple."""

    module: Any
    input_names: list[str]
    output_names: list[str]
    description: str
    warnings: list[str] = field(default_factory=list)  # what the report says about the loaded model (weights left out)


def hf_folder(source: ModelSource) -> Path:
    """The Hugging Face folder of the model (for a model built from a config: of its tokenizer)."""
    spec = source.model
    tokenizer_only = isinstance(spec, (HFConfigModel, OnnxModel))  # the folder of a tokenizer alone: no config.json needed
    if tokenizer_only:
        if spec.tokenizer is None:
            raise ModelSourceError("model.tokenizer: text data needs a tokenizer, and "
                                   f"{'an ONNX file' if isinstance(spec, OnnxModel) else 'a model built from its config'} has "
                                   "none; add `tokenizer: {hf: FOLDER}` (or `{package: ..., subdir: ...}`) to `model`, or give "
                                   "the data as npz/npy arrays of token ids")
        spec = spec.tokenizer
    if not isinstance(spec, HFModel):
        raise DataError(
            f"data: text needs the model's tokenizer, and the model is a {type(spec).__name__}, which has none; use an `hf` "
            "model, or give the data as npz/npy arrays of token ids"
        )
    if spec.hf is not None:
        folder = source.resolve(spec.hf)
    else:
        found = importlib.util.find_spec(spec.package)
        if found is None or not found.submodule_search_locations:
            raise ModelSourceError(
                f"model.package: package '{spec.package}' is not installed; install it (pip install "
                f"{spec.package.replace('_', '-')}) or point `hf` at a local folder"
            )
        folder = Path(list(found.submodule_search_locations)[0]) / spec.subdir
    if not folder.exists():
        hub = hub_id_hint(spec.hf) if spec.hf is not None else ""
        raise ModelSourceError(f"model: '{folder}' does not exist; point the recipe at a Hugging Face model folder (from a "
                               f"GGUF checkpoint, write one with scripts/gguf_to_hf.py, as the recipe's comments say){hub}")
    if not (folder / "config.json").is_file() and not (tokenizer_only and any((folder / name).is_file() for name in TOKENIZER_FILES)):
        raise ModelSourceError(f"model: '{folder}' has no config.json; point the recipe at a Hugging Face model folder")
    return folder


#: A folder that holds a tokenizer (a model's own tokenizer needs no config.json beside it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def forward_failure(feeds: dict[str, np.ndarray], reason: str) -> str:
    """The sentence for a forward() that fails on the recipe's inputs (when the model loads, and at export)."""
    shapes = ", ".join(f"{name} {list(v.shape)} {v.dtype}" for name, v in feeds.items())
    return (f"the PyTorch model fails on the recipe's inputs ({shapes}): {reason}; "
            "make `inputs` (names, dtypes, shapes) match what its forward() takes")


def source_fingerprint(source: ModelSource) -> dict[str, Any]:
    """What identifies the model source's content, for the export stage's cache key."""
    spec = source.model
    if isinstance(spec, HFModel):
        folder = hf_folder(source)
        return {"hf": _folder_hash(folder), "task": spec.task, "outputs": spec.outputs}
    if isinstance(spec, HFConfigModel):
        tokenizer = _folder_hash(hf_folder(source)) if spec.tokenizer else None
        return {"hf_config": spec.hf_config, "task": spec.task, "outputs": spec.outputs, "seed": spec.seed, "weights": "random", "tokenizer": tokenizer}
    if isinstance(spec, OnnxModel):
        from optpipe.safety.onnx_guard import external_locations, load_graph

        path = onnx_source_path(source)
        locations = external_locations(load_graph(path, "model.onnx"))
        found = {"onnx": sha256_file(path), "data": {loc: sha256_file(path.parent / loc) for loc in locations}}
        # A tokenizer only where one is named: the keys of the ONNX sources without one stay as they were.
        return found | ({"tokenizer": _folder_hash(hf_folder(source))} if spec.tokenizer else {})
    if isinstance(spec, FactoryModel):
        module_name = spec.factory.partition(":")[0]
        origin = _module_origin(module_name, source)
        checkpoint = source.resolve(spec.checkpoint)
        weights = sha256_file(checkpoint) if checkpoint and checkpoint.is_file() else None
        code = code_digests(module_name, origin) if origin else None
        return {"factory": spec.factory, "kwargs": spec.kwargs, "code": code, "kwargs_files": kwargs_files(spec.kwargs, source),
                "checkpoint": weights, "outputs": spec.outputs}
    if isinstance(spec, TorchvisionModel):
        return {"torchvision": spec.torchvision, "num_classes": spec.num_classes, "weights": "random", "outputs": spec.outputs}
    if isinstance(spec, TorchScriptModel):
        archive = source.resolve(spec.torchscript)
        return {"torchscript": sha256_file(archive) if archive.is_file() else None, "outputs": spec.outputs}
    raise ModelSourceError("model: unsupported model kind")


def onnx_path(source: ModelSource) -> Path | None:
    """The model file of an ONNX recipe, checked to exist; None for a PyTorch model."""
    return onnx_source_path(source) if isinstance(source.model, OnnxModel) else None


def onnx_source_path(source: ModelSource) -> Path:
    spec = source.model
    assert isinstance(spec, OnnxModel)
    path = source.resolve(spec.onnx)
    from optpipe.safety.onnx_guard import check_model_path

    check_model_path(path, "model.onnx")
    return path


#: A Hugging Face Hub id (`owner/name`): what users copy from a model card, and what optpipe never downloads
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id_hint(text: str) -> str:
    """For a path that does not exist and could be a Hub id: '; if ... is a Hub id, how to get its folder', else ''.
    Said beside the other causes: 'models/gemma' is as likely a folder not written yet."""
    if not HUB_ID.match(text) or text.endswith((".onnx", ".json", ".yaml")):
        return ""
    return (f"; if '{text}' is a Hugging Face Hub id: optpipe loads nothing from a hub, download the folder first "
            f"(huggingface-cli download {text} --local-dir DIR) and give DIR")


def load_torch_model(source: ModelSource) -> TorchModel:
    """The recipe's model as a torch module in eval mode."""
    spec = source.model
    if isinstance(spec, HFModel):
        return _load_hf(source, spec)
    if isinstance(spec, HFConfigModel):
        return _load_hf_config(source, spec)
    if isinstance(spec, TorchvisionModel):
        return _load_torchvision(source, spec)
    if isinstance(spec, FactoryModel):
        return _load_factory(source, spec)
    if isinstance(spec, TorchScriptModel):
        net = load_torchscript(source.resolve(spec.torchscript))
        name = Path(spec.torchscript).name
        return _flattened(net.eval(), source, _bound(net, source, name), f"TorchScript {name}")
    raise ModelSourceError("model: an ONNX model has no PyTorch module; stages that need one (export checks, prune) cannot run")


# Optimum's task names (and short aliases) -> transformers Auto classes, as optimum.exporters.tasks maps them.
HF_AUTO_CLASSES = {
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "fill-mask": "AutoModelForMaskedLM",
    "masked-lm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",  # an encoder-decoder's one teacher-forced forward: logits over decoder_input_ids
    "text2text-generation": "AutoModelForSeq2SeqLM",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",  # Whisper's: log-mel features in, logits over decoder_input_ids
    "text-generation": "AutoModelForCausalLM",
    "image-classification": "AutoModelForImageClassification",
    "object-detection": "AutoModelForObjectDetection",
    "semantic-segmentation": "AutoModelForSemanticSegmentation",
    "audio-classification": "AutoModelForAudioClassification",
    "multiple-choice": "AutoModelForMultipleChoice",  # input ids [batch, choices, sequence], logits [batch, choices]
    "pretraining": "AutoModelForPreTraining",
    "next-sentence-prediction": "AutoModelForNextSentencePrediction",
    "ctc": "AutoModelForCTC",  # wav2vec2-style speech recognition: raw audio in, per-frame logits
    "audio-frame-classification": "AutoModelForAudioFrameClassification",
    "audio-xvector": "AutoModelForAudioXVector",
    "depth-estimation": "AutoModelForDepthEstimation",
    "video-classification": "AutoModelForVideoClassification",
}
# Decoders without past key/values: the exported graph takes the whole sequence and returns logits
# (Optimum's "text-generation" without "-with-past").
NO_CACHE_TASKS = ("causal-lm", "text-generation", "seq2seq-lm", "text2text-generation", "speech-seq2seq")


def _auto_class(task: str):
    import transformers

    return getattr(transformers, HF_AUTO_CLASSES[task])


@contextmanager
def _no_loading_bar():
    """transformers' "Loading weights" tqdm bar, off while optpipe loads: it wrote into the console's progress
    lines (and a log file's) on every load; the user's own setting is put back."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load_hf(source: ModelSource, spec: HFModel) -> TorchModel:
    folder = hf_folder(source)
    cls = _auto_class(spec.task)
    extra = {"use_cache": False} if spec.task in NO_CACHE_TASKS else {}
    config = folder_config(folder)
    refuse_prequantized(config, folder, "model")
    import torch

    try:
        # Read straight into float32 (as_float32 says why): no half-precision copy beside it.
        with _no_loading_bar():
            model, loading = cls.from_pretrained(str(folder), local_files_only=True, trust_remote_code=spec.trust_remote_code,
                                                 dtype=torch.float32, output_loading_info=True, **extra)
    except Exception as exc:  # transformers raises many types; all mean "cannot load this folder"
        raise ModelSourceError(f"model: cannot load '{folder}' as {spec.task} ({cls.__name__}): {first_line(exc)}") from None
    torch_model = _wrap_hf(model, source, f"{cls.__name__} from {folder}{widening_note(stored_dtype(config))}")
    torch_model.warnings = loading_warnings(loading, cls.__name__, spec.task, (config.get("architectures") or [""])[0])
    return torch_model


def _load_hf_config(source: ModelSource, spec: HFConfigModel) -> TorchModel:
    import torch
    import transformers

    options = dict(spec.hf_config)
    model_type = options.pop("model_type")
    if spec.task in NO_CACHE_TASKS:
        options.setdefault("use_cache", False)
    try:
        config = transformers.AutoConfig.for_model(model_type, **options)
    except Exception as exc:  # unknown model types, bad config keys
        raise ModelSourceError(f"model.hf_config: transformers cannot build a '{model_type}' config: {first_line(exc)}") from None
    cls = _auto_class(spec.task)
    torch.manual_seed(spec.seed)
    try:
        model = cls.from_config(config, dtype=torch.float32)  # a config's `dtype: bfloat16` would build it in bf16
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):  # a config the architecture refuses (heads vs hidden size...)
            raise _config_refused(model_type, exc) from None
        raise ModelSourceError(f"model.task: '{model_type}' has no {spec.task} head ({first_line(exc)}); pick another task") from None
    except Exception as exc:  # noqa: BLE001 - modules assert on their sizes (nn.Embedding: "Padding_idx must be within num_embeddings")
        raise _config_refused(model_type, exc) from None
    note = widening_note(stored_dtype(options))
    return _wrap_hf(model, source, f"{type(model).__name__} from {type(config).__name__} (random weights, seed {spec.seed}){note}")


def _config_refused(model_type: str, exc: BaseException) -> ModelSourceError:
    return ModelSourceError(f"model.hf_config: transformers cannot build a '{model_type}' model from this config "
                            f"({first_line(exc)}); fix the values it names in hf_config")


def _wrap_hf(model, source: ModelSource, description: str) -> TorchModel:
    """The model in eval mode, taking the recipe's inputs by keyword and returning its chosen tensor outputs."""
    names = [spec_.name for spec_ in source.inputs]
    return _flattened(model.eval(), source, lambda m, *args: m(**dict(zip(names, args))), description)


def _flattened(net, source: ModelSource, call, description: str) -> TorchModel:
    """`net` behind a module that returns a flat tuple of named tensors, chosen by `model.outputs`.

    One forward pass on example inputs finds the output structure. It runs under no_grad, never
    inference_mode: a model that caches tensors in forward (a detector's anchor grid) would keep
    inference tensors, which export cannot save for backward."""
    import torch

    from optpipe.source.model_outputs import flat_module, named_leaves, pick_outputs

    refuse_quantized_modules(net)
    converted = as_float32(net)
    description += widening_note(converted) if converted and "float32:" not in description else ""
    sample = example_inputs(source, batch=1)
    args = [torch.from_numpy(sample[s.name]) for s in source.inputs]
    try:
        with torch.no_grad():
            returned = call(net, *args)
            leaves = named_leaves(returned)
    except (MemoryError, ModelSourceError):  # the machine's limit; named_leaves' own sentence
        raise
    except Exception as exc:  # whatever forward() raises on inputs it does not accept
        raise ModelSourceError(forward_failure(sample, first_line(exc))) from None
    declared = getattr(net, "output_names", None)
    indices, output_names = pick_outputs([name for name, _ in leaves], source.model.outputs, declared)
    module = net if scripted_as_is(net, returned, indices) else flat_module(net, call, indices)
    return TorchModel(module.eval(), [s.name for s in source.inputs], output_names, description)


def _load_torchvision(source: ModelSource, spec: TorchvisionModel) -> TorchModel:
    try:
        import torchvision.models as tvm
    except Exception as exc:
        raise ModelSourceError(
            f"model.torchvision: torchvision does not import ({first_line(exc)}); install optpipe[vision]"
        ) from None
    builder = getattr(tvm, spec.torchvision, None)
    if builder is None:
        raise ModelSourceError(f"model.torchvision: no architecture '{spec.torchvision}' in torchvision.models")
    module = builder(weights=None, num_classes=spec.num_classes).eval()
    module.output_names = ["logits"]
    return _flattened(module, source, positional, f"torchvision {spec.torchvision} (random weights)")


def _load_factory(source: ModelSource, spec: FactoryModel) -> TorchModel:
    module_name, _, func_name = spec.factory.partition(":")
    if not func_name:
        raise ModelSourceError(f"model.factory: expected 'module:function', got '{spec.factory}'")
    if spec.path:
        folder = str(source.resolve(spec.path))
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSourceError(f"model.factory: cannot import '{module_name}': {first_line(exc)}; check `model.factory` and `model.path`") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ModelSourceError(f"model.factory: '{module_name}' has no function '{func_name}'")
    try:
        built = func(**spec.kwargs)
    except Exception as exc:  # the user's code: report it as theirs
        raise ModelSourceError(f"model.factory: '{spec.factory}' raised {type(exc).__name__}: {first_line(exc)}; check the factory and `model.kwargs`") from None
    net = built[0] if isinstance(built, tuple) else built
    refuse_unexportable(net, f"model.factory: '{spec.factory}'")
    if not callable(getattr(net, "eval", None)):
        raise ModelSourceError(f"model.factory: '{spec.factory}' returned {type(net).__name__}, not a torch.nn.Module; return the module")
    if spec.checkpoint:
        from optpipe.safety.checkpoints import load_checkpoint

        load_checkpoint(net, source.resolve(spec.checkpoint), spec.allow_pickle)
    return _flattened(net.eval(), source, _bound(net, source, spec.factory), f"factory {spec.factory}")


def _bound(net, source: ModelSource, where: str):
    """forward() called with the recipe's inputs by name where they name its parameters (module_forms.input_binding)."""
    return input_binding(net, [spec_.name for spec_ in source.inputs], where)


def _module_origin(module_name: str, source: ModelSource) -> Path | None:
    spec = source.model
    if isinstance(spec, FactoryModel) and spec.path:
        candidate = source.resolve(spec.path) / (module_name.replace(".", "/") + ".py")
        if candidate.is_file():
            return candidate
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found and found.origin and found.origin.endswith(".py") else None


def _folder_hash(folder: Path) -> str:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    # One run asks several times (stage keys, the eager baseline's key): files unchanged since the
    # last ask (same names, sizes, modification times) are not read again (~90 MB for MiniLM).
    signature = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _files_hash(folder, signature)


@lru_cache(maxsize=16)
def _files_hash(folder: Path, signature: tuple) -> str:
    digest = hashlib.sha256()
    for name, _, _ in signature:
        path = Path(name)
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()
