"""Labels beside the samples, for task metrics against ground truth (evaluate.task):

- an npz source holding a `labels` array (when no model input is called `labels`);
- `labels: file.npy` on any source: one integer per sample, in the samples' order;
- an images folder whose images sit in one subfolder per class (`cat/1.jpg`, `dog/2.jpg`):
  the label is the class folder's index in name order, as torchvision's ImageFolder does.

Labels travel inside the cached sample set under a reserved name and come out as
`SampleSet.labels`, never as a model input.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from optpipe.core.errors import DataError
from optpipe.recipe.schema import DataSource, ModelSource

LABELS = "labels"
LABELS_KEY = "__labels__"  # the name inside a cached sample set


def split_labels(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    inputs = {k: v for k, v in arrays.items() if k != LABELS_KEY}
    return inputs, arrays.get(LABELS_KEY)


def attach_labels(samples: dict[str, np.ndarray], source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    """Move an npz's `labels` array, or read `source.labels`, under the reserved key; check the count."""
    inputs = {spec.name for spec in model.inputs}
    if LABELS in samples and LABELS not in inputs:
        samples = {**samples, LABELS_KEY: samples[LABELS]}
        del samples[LABELS]
    if source.labels:
        path = _labels_path(source, model)
        try:
            labels = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"data: labels '{source.labels}' is not a readable .npy file ({exc}); give an .npy array of integers") from None
        samples = {**samples, LABELS_KEY: labels}
    if LABELS_KEY in samples:
        samples[LABELS_KEY] = _checked(samples[LABELS_KEY], samples, inputs, source)
    return samples


def labels_fingerprint(source: DataSource, model: ModelSource) -> str | None:
    """The labels file's content hash: new labels make a new sample set."""
    if not source.labels:
        return None
    from optpipe.core.artifact import sha256_file

    return sha256_file(_labels_path(source, model))


def class_folders(folder: Path) -> list[Path]:
    """The class subfolders of an images folder (those holding images), by name; [] for a flat folder."""
    from optpipe.calibration.images import IMAGE_SUFFIXES

    if not folder.is_dir() or any(p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES for p in folder.iterdir()):
        return []
    return sorted(d for d in folder.iterdir() if d.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in d.iterdir()))


def load_class_folders(folder: Path, source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    """`source.samples` images from class subfolders, classes interleaved, with their labels."""
    from optpipe.calibration.images import image_files, load_image_folder

    classes = class_folders(folder)
    counts = [len(image_files(d, None)) for d in classes]
    total = sum(counts)
    parts, labels = [], []
    for index, (sub, count) in enumerate(zip(classes, counts)):
        # Each class's share of the samples (at least one), repeating variants of its images if asked for more.
        share = max(1, -(-source.samples * count // total))
        arrays = load_image_folder(sub, source.model_copy(update={"samples": share}), model)
        parts.append(arrays)
        labels.append(np.full(share, index, dtype=np.int64))
    name = next(iter(parts[0]))
    order = _interleave([len(x) for x in labels])[: source.samples]
    stacked = np.concatenate([p[name] for p in parts])
    return {name: stacked[order], LABELS_KEY: np.concatenate(labels)[order]}


def _interleave(sizes: list[int]) -> np.ndarray:
    """Indices into the concatenated classes, taking one of each class in turn (so a prefix covers every class)."""
    starts = np.cumsum([0] + sizes[:-1])
    order = []
    for i in range(max(sizes)):
        order += [start + i for start, size in zip(starts, sizes) if i < size]
    return np.asarray(order, dtype=np.int64)


def _labels_path(source: DataSource, model: ModelSource) -> Path:
    path = model.resolve(source.labels)
    if path is None or not path.is_file():
        raise DataError(f"data: labels file '{source.labels}' does not exist; fix `labels` in the recipe's data section")
    return path


def _checked(labels: np.ndarray, samples: dict[str, np.ndarray], inputs: set[str], source: DataSource) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"data: labels must be one integer per sample, got {labels.dtype} of shape {labels.shape}")
    count = len(next(v for k, v in samples.items() if k in inputs)) if inputs & set(samples) else len(labels)
    if len(labels) < count:
        raise DataError(f"data: {len(labels)} labels for {count} samples; give one label per sample")
    return labels[:count].astype(np.int64)
