"""A sample set built once and cached as arrays under a key covering what it was built from.

The key covers the source's content (not just its path), the preprocessing, the
sample count, the seed and the input specs, so editing a data file invalidates
the set while renaming it does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from optpipe.core.artifact import sha256_file, sha256_json
from optpipe.core.errors import DataError
from optpipe.core.runtime import first_non_finite
from optpipe.calibration.labels import labels_fingerprint, split_labels
from optpipe.calibration.sources import check_samples, load_samples, running_text, source_path
from optpipe.recipe.schema import DataSource, ModelSource

DATASETS = "datasets"
SAMPLES_FILE = "samples.npz"


@dataclass(frozen=True)
class SampleSet:
    """Samples stacked along axis 0 for every input, plus the key that identifies them."""

    arrays: dict[str, np.ndarray]
    key: str
    cached: bool = False
    labels: np.ndarray | None = None  # one label per sample, where the source has them (calibration/labels.py)
    origin: str | None = None  # the data source's kind (synthetic, images, ...): a pass calibrated on made-up data says so

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(self), batch_size):
            yield {name: array[start : start + batch_size] for name, array in self.arrays.items()}

    def first(self, count: int) -> dict[str, np.ndarray]:
        """The first `count` samples, repeating the set if it is shorter."""
        reps = -(-count // len(self))
        return {name: np.concatenate([array] * reps)[:count] for name, array in self.arrays.items()}


def sample_set_key(source: DataSource, model: ModelSource) -> str:
    path = source_path(source, model)
    content = None
    if path is not None:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        content = {str(p.relative_to(path)) if path.is_dir() else "file": sha256_file(p) for p in files}
    tokenizer, layout = None, {}
    if source.source == "text":
        from optpipe.source.model_source import source_fingerprint

        tokenizer = source_fingerprint(model)
        layout = {"text": "windows of running text"} if running_text(model) else {}  # other sets keep their keys
    return sha256_json(
        {
            **layout,
            "format": 2,
            "source": source.model_dump(exclude={"path", "labels"}),
            "content": content,
            "labels": labels_fingerprint(source, model),
            "inputs": [spec.model_dump() for spec in model.inputs],
            "dims": {name: dim.model_dump() for name, dim in model.dims.items()},
            "tokenizer": tokenizer,
        }
    )


def build_sample_set(source: DataSource, model: ModelSource, cache: "StageCache | Path") -> SampleSet:
    """Load the cached set if its key matches (verified against its hash), else build and publish it.

    The set is a cache entry like a stage's model (`datasets/<key>/samples.npz` and a
    manifest): published atomically, re-hashed on use, built by one process at a time.
    """
    from optpipe.cache.store import StageCache

    key = sample_set_key(source, model)
    cache = cache if isinstance(cache, StageCache) else StageCache(cache)
    with cache.lock(key):
        folder = cache.lookup_folder(key, DATASETS)
        if folder is not None:
            arrays = _read_arrays(folder / SAMPLES_FILE)
            if arrays is not None:
                arrays, labels = split_labels(arrays)
                # checked again: a set cached before a check existed (inputs of unlike sample counts) is refused as new
                check_samples(arrays, model, what=f"data source '{source.source}'")
                return SampleSet(arrays, key, cached=True, labels=labels, origin=source.source)
            cache.discard(folder)
        arrays = load_samples(source, model)
        workdir = cache.new_workdir()
        try:
            with open(workdir / SAMPLES_FILE, "wb") as fh:
                np.savez(fh, **arrays)
            cache.publish_folder(key, workdir, DATASETS, {"source": source.source, "samples": len(next(iter(arrays.values())))})
        finally:
            cache.release_workdir(workdir)
    arrays, labels = split_labels(arrays)
    return SampleSet(arrays, key, cached=False, labels=labels, origin=source.source)


def _read_arrays(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError):
        return None  # unreadable although its hash matched (an older numpy?): rebuild


def require_finite_calibration(samples: SampleSet) -> SampleSet:
    """A calibration set with NaN or Inf gives ranges that mean nothing: ORT's static quantizer stopped with "scale
    issue", which named neither the data nor the input. (An evaluation set may hold them: a model can handle a missing
    value; where its outputs then turn NaN, the evaluation names the input.)"""
    found = first_non_finite(samples.arrays)
    if found:
        name, bad, size = found
        raise DataError(f"data.calibration: input '{name}' holds NaN or Inf ({bad} of {size} values), so no quantization range "
                        "can be calibrated from it; fix the data (or calibrate on a set without them)")
    return samples
