"""Sample sources: synthetic from the input specs, a text file through the tokenizer, arrays, images.

Each source returns {input name: array with the samples along axis 0}.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from optpipe.calibration.array_rows import npy_rows, npz_rows
from optpipe.calibration.labels import attach_labels, class_folders, load_class_folders
from optpipe.core.errors import DataError, first_line
from optpipe.core.runtime import DECODER_IDS
from optpipe.recipe.example_inputs import synthetic_inputs
from optpipe.recipe.generation_spec import CAUSAL_TASKS
from optpipe.recipe.schema import DataSource, ModelSource


def load_samples(source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    """All samples of a source, batch-stacked along axis 0."""
    loaders = {"synthetic": _synthetic, "text": _text, "npy": _npy, "npz": _npz, "images": _images}
    try:
        samples = attach_labels(loaders[source.source](source, model), source, model)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, MemoryError) as exc:  # MemoryError: a header declaring a huge shape
        # numpy refuses pickled object arrays (allow_pickle=False) and raises these on broken files
        if source.source == "synthetic":  # no file to blame: the sizes are
            raise DataError(f"data: cannot build {source.samples} synthetic samples ({first_line(exc)[:160]}); lower `samples` "
                            "or the dims' `opt`") from None
        raise DataError(
            f"data: '{source.path}' is not a readable {source.source} file ({first_line(exc)[:160]}); "
            f"give {WANTED[source.source]}"
        ) from None
    check_samples(samples, model, what=f"data source '{source.source}'")
    return samples


#: What each file source reads, for the line that refuses a file it cannot read.
WANTED = {
    "text": "a UTF-8 text file, one sentence per line (a causal LM's: running text)",
    "npy": "an .npy file of one plain numeric array",
    "npz": "an .npz file of plain numeric arrays named after the inputs",
    "images": "a folder of images (or of one folder of images per class)",
}

PACKAGE_PREFIX = "package:"


def source_path(source: DataSource, model: ModelSource) -> Path | None:
    path = package_path(source.path) if (source.path or "").startswith(PACKAGE_PREFIX) else model.resolve(source.path)
    if path is not None and not path.exists():
        raise DataError(f"data: file '{path}' does not exist; fix `path` in the recipe's data section")
    if path is not None and not (path.is_file() or path.is_dir()):  # a FIFO or a device would block or never end
        raise DataError(f"data: '{path}' is not a regular file or folder (a device or a pipe); give a data file")
    return path


def package_path(spec: str) -> Path:
    """`package:skimage/data` -> the `data` folder inside the installed package `skimage` (data shipped in wheels)."""
    import importlib.util

    package, _, inner = spec[len(PACKAGE_PREFIX):].partition("/")
    found = importlib.util.find_spec(package) if package else None
    if found is None or not found.submodule_search_locations:
        raise DataError(f"data: path '{spec}' names package '{package}', which is not installed; install it or use a folder path")
    return Path(list(found.submodule_search_locations)[0]) / inner


def check_samples(samples: dict[str, np.ndarray], model: ModelSource, what: str) -> None:
    """Every input present, with the declared dtype and rank, fixed dims matching and dynamic dims in range."""
    for i, spec in enumerate(model.inputs):
        if spec.name not in samples:
            raise DataError(f"{what} has no array for input '{spec.name}'; it has {sorted(samples)}; name the arrays after the inputs")
        array = samples[spec.name]
        if array.dtype != np.dtype(spec.dtype):
            raise DataError(f"{what}: input '{spec.name}' is {array.dtype}, the recipe says {spec.dtype}; convert the data or fix inputs.{i}.dtype")
        if array.ndim != len(spec.shape):
            raise DataError(
                f"{what}: input '{spec.name}' has rank {array.ndim}, the recipe's shape {spec.shape} has {len(spec.shape)}; "
                "stack the samples along axis 0 with the recipe's shape"
            )
        for axis, dim in enumerate(spec.shape):
            if axis == 0:
                continue  # samples are stacked along axis 0
            size = array.shape[axis]
            if isinstance(dim, int) and size != dim:
                raise DataError(f"{what}: input '{spec.name}' has size {size} on axis {axis}, the recipe says {dim}; fix the data or inputs.{i}.shape")
            if isinstance(dim, str) and not model.dims[dim].allows(size):
                raise DataError(
                    f"{what}: input '{spec.name}' has size {size} on axis {axis}, not a multiple of "
                    f"{model.dims[dim].multiple_of} (dims.{dim}.multiple_of); resize the data to {model.dims[dim].nearest(size)}"
                )
            if isinstance(dim, str) and not model.dims[dim].min <= size <= model.dims[dim].max:
                bounds = model.dims[dim]
                raise DataError(
                    f"{what}: input '{spec.name}' has size {size} on axis {axis}, outside dims.{dim} "
                    f"[{bounds.min}, {bounds.max}]; fix the data or widen the dim"
                )
    _same_sample_counts(samples, model, what)


def _same_sample_counts(samples: dict[str, np.ndarray], model: ModelSource, what: str) -> None:
    """One row per sample in every input: an npz whose mask held 30 rows beside 32 of ids failed as an internal error
    ("index 30 is out of bounds") once the batches were cut."""
    counts = {spec.name: len(samples[spec.name]) for spec in model.inputs if samples[spec.name].ndim}
    if len(set(counts.values())) > 1:
        held = ", ".join(f"'{name}' {count}" for name, count in counts.items())
        raise DataError(f"{what}: the inputs hold different numbers of samples ({held}); give every input one row per sample")


def _synthetic(source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    batch_dim = model.batch_dim()
    if batch_dim is None:
        batches = [synthetic_inputs(model, seed=source.seed + i) for i in range(source.samples)]
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    return synthetic_inputs(model, seed=source.seed, **{batch_dim: source.samples})


def _text(source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    """Lines of a text file through the model's own tokenizer, padded to the `opt` sequence length (a causal
    LM's: windows of the file as running text)."""
    from optpipe.source.model_source import hf_folder

    tokenizer_folder = hf_folder(model)  # before importing transformers: a model without a tokenizer fails fast
    from transformers import AutoTokenizer

    path = source_path(source, model)
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise DataError(f"data: text file '{path}' has no non-empty lines")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder), local_files_only=True)
    seq_len = _sequence_length(model)
    if running_text(model):
        return _text_windows(" ".join(lines), tokenizer, seq_len, source, model, path)
    lines = (lines * (source.samples // len(lines) + 1))[: source.samples]
    encoded = dict(tokenizer(lines, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np"))
    if any(spec.name == DECODER_IDS for spec in model.inputs) and DECODER_IDS not in encoded:
        encoded[DECODER_IDS] = _decoder_ids(encoded["input_ids"], model)
    return _tokenizer_inputs(encoded, model)


def _decoder_ids(input_ids: np.ndarray, model: ModelSource) -> np.ndarray:
    """An encoder-decoder's decoder_input_ids from text alone: each line as its own target, shifted right behind the
    decoder's start token (as transformers' shift_tokens_right builds them from labels for T5's and BART's
    denoising), cut to the target dim's `opt`. A text file holds no other target; a translation's real targets
    can be given as npz arrays."""
    spec = next(s for s in model.inputs if s.name == DECODER_IDS)
    dim = spec.shape[1] if len(spec.shape) > 1 else None
    length = dim if isinstance(dim, int) else model.dims[dim].opt if dim else input_ids.shape[1]
    start = _decoder_start(model)
    shifted = np.concatenate([np.full((len(input_ids), 1), start, input_ids.dtype), input_ids], axis=1)[:, :length]
    if shifted.shape[1] < length:  # a target dim longer than the source's: the rest filled with the start token
        shifted = np.pad(shifted, ((0, 0), (0, length - shifted.shape[1])), constant_values=start)
    return shifted


def _decoder_start(model: ModelSource) -> int:
    """The config's decoder_start_token_id (else its pad token, T5's start; else 0)."""
    from optpipe.source.torch_weights import config_options

    try:
        config = config_options(model)
    except (OSError, ValueError):  # a config.json transformers will name when it loads the model
        config = {}
    config = config if isinstance(config, dict) else {}
    for key in ("decoder_start_token_id", "pad_token_id"):
        if isinstance(config.get(key), int):
            return config[key]
    return 0


def _tokenizer_inputs(encoded, model: ModelSource) -> dict[str, np.ndarray]:
    """The recipe's inputs, by name, from what the tokenizer gave."""
    out = {}
    for spec in model.inputs:
        if spec.name not in encoded:
            raise DataError(f"data: the tokenizer gives {sorted(encoded)}, not the recipe's input '{spec.name}'")
        out[spec.name] = encoded[spec.name].astype(spec.dtype)
    return out


def running_text(model: ModelSource) -> bool:
    """A causal LM reads a text file as running text, not as a line per sample."""
    return getattr(model.model, "task", None) in CAUSAL_TASKS


def _text_windows(text: str, tokenizer, seq_len: int, source: DataSource, model: ModelSource, path: Path) -> dict[str, np.ndarray]:
    """A causal LM's samples: the text as one token stream cut into windows of the `opt` sequence length,
    each opening with the tokenizer's BOS where it has one, as LLM calibration sets are built (GPTQ's and
    AWQ's windows of running text). Why not a padded line per sample: a decoder's one forward takes no
    padding mask from the recipe's inputs (the prefill runs with a mask of ones), and Gemma's tokenizer pads
    on the left, so the pad tokens would sit in every window's context and in its activation statistics."""
    bos = tokenizer.bos_token_id
    stream = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # cut into windows: no length warning
    step = seq_len - (bos is not None)
    count = len(stream) // step
    if count == 0:
        raise DataError(f"data: text file '{path}' has {len(stream)} tokens, fewer than one window of {seq_len} (the "
                        "sequence dim's opt) that a causal LM's samples are; give a longer text or lower that opt")
    windows = np.asarray(stream[: count * step], np.int64).reshape(count, step)
    if bos is not None:
        windows = np.concatenate([np.full((count, 1), bos, np.int64), windows], axis=1)
    windows = windows[np.arange(source.samples) % count]  # as lines are: repeated up to `samples`
    return _tokenizer_inputs({"input_ids": windows, "attention_mask": np.ones_like(windows),
                              "token_type_ids": np.zeros_like(windows)}, model)


def _sequence_length(model: ModelSource) -> int:
    shape = model.inputs[0].shape
    if len(shape) < 2:
        raise DataError("data: text sources need inputs shaped [batch, sequence]")
    dim = shape[1]
    return dim if isinstance(dim, int) else model.dims[dim].opt


def _npy(source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    if len(model.inputs) != 1:
        raise DataError("data: an .npy file holds one array; the model has several inputs, use an .npz keyed by input name")
    return {model.inputs[0].name: npy_rows(source_path(source, model), source.samples)}


def _npz(source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    return npz_rows(source_path(source, model), source.samples)


def _images(source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    from optpipe.calibration.images import load_image_folder

    folder = source_path(source, model)
    if class_folders(folder):
        return load_class_folders(folder, source, model)
    return load_image_folder(folder, source, model)
