"""Readers that feed one cached SampleSet to ONNX Runtime, Polygraphy and TensorRT.

The set is built once (calibration/dataset.py); these adapters only slice it into
batches and keep the inputs a model actually takes, so one set serves every consumer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from optpipe.calibration.dataset import SampleSet
from optpipe.core.errors import DataError, OptpipeError

Feeds = dict[str, np.ndarray]


def sample_batches(samples: SampleSet, batch_size: int = 1, input_names: Iterable[str] | None = None,
                   whole: bool = False) -> list[Feeds]:
    """The set as a list of feed dicts of `batch_size` samples (the last may be smaller; `whole`: a model whose
    batch is fixed cannot take it, and it is dropped)."""
    keep = set(input_names) if input_names is not None else None
    if keep is not None and not keep <= set(samples.arrays):
        missing = sorted(keep - set(samples.arrays))
        raise DataError(f"the calibration set has no arrays for model inputs {missing}; it has {sorted(samples.arrays)}")
    if whole and len(samples) < batch_size:
        raise DataError(f"data.calibration: {len(samples)} samples, fewer than the model's fixed batch of {batch_size}; "
                        f"give at least {batch_size} samples")
    return [
        {name: np.ascontiguousarray(array) for name, array in batch.items() if keep is None or name in keep}
        for batch in samples.batches(batch_size) if not whole or len(next(iter(batch.values()))) == batch_size
    ]


def model_input_names(model_path: Path) -> list[str]:
    """Graph inputs that are not initializers: what a session must be fed."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def ort_calibration_reader(samples: SampleSet, model_path: Path, batch_size: int = 1,
                           progress: Callable[[int, int], None] | None = None, whole: bool = False):
    """An `onnxruntime.quantization.CalibrationDataReader` over the set, rewindable.

    `progress(n, total)`: told as ORT's calibrator takes batch n of its range; (total + 1, total)
    when it asks past the end (it has read them all: it computes the ranges next)."""
    from onnxruntime.quantization import CalibrationDataReader

    batches = sample_batches(samples, batch_size, model_input_names(model_path), whole)

    class SampleSetReader(CalibrationDataReader):
        def __init__(self):
            self._start, self._end = 0, len(batches)
            self._position = 0

        def get_next(self) -> Feeds | None:
            total = self._end - self._start
            if self._position >= self._end:
                if progress is not None:
                    progress(total + 1, total)
                return None
            self._position += 1
            if progress is not None:
                progress(self._position - self._start, total)
            return batches[self._position - 1]

        def __len__(self) -> int:
            return len(batches)

        def rewind(self) -> None:
            self._position = self._start

        def set_range(self, start_index: int, end_index: int) -> None:
            # Used by ORT's strided MinMax calibration: serve batches [start, end) only.
            self._start, self._end = start_index, min(end_index, len(batches))
            self._position = self._start

    return SampleSetReader()


class PolygraphyDataLoader:
    """A Polygraphy data loader (a sized iterable of feed dicts) over the set.

    Polygraphy sets `input_metadata` on loaders it is given; the feeds are cast to the
    dtypes it asks for, so a recipe's int64 ids still feed a model declared int32.
    """

    def __init__(self, samples: SampleSet, batch_size: int = 1, input_names: Iterable[str] | None = None):
        self._batches = sample_batches(samples, batch_size, input_names)
        self.input_metadata = None

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: int) -> Feeds:
        return self._cast(self._batches[index])

    def __iter__(self) -> Iterator[Feeds]:
        return (self._cast(batch) for batch in self._batches)

    def _cast(self, feeds: Feeds) -> Feeds:
        if not self.input_metadata:
            return feeds
        out = {}
        for name, array in feeds.items():
            meta = self.input_metadata[name] if name in self.input_metadata else None
            dtype = getattr(meta, "dtype", None)
            out[name] = array.astype(_numpy_dtype(dtype)) if dtype is not None else array
        return out


def _numpy_dtype(dtype):
    try:
        return np.dtype(dtype)
    except TypeError:  # Polygraphy's own DataType: ask it for the NumPy equivalent
        from polygraphy.datatype import DataType

        return DataType.to_dtype(dtype, "numpy")


def tensorrt_calibrator(samples: SampleSet, cache_path: Path, batch_size: int = 1, input_names: Iterable[str] | None = None):
    """A TensorRT IInt8 calibrator (Polygraphy's `Calibrator`) over the set.

    Implicit INT8 calibration was deprecated in TensorRT 10.1 and removed in 11, where
    precision lives in the graph's Q/DQ nodes instead (the int8 pass writes those).
    `cache_path` must already be keyed by model and data: Polygraphy reuses any
    non-empty cache file without checking what produced it.
    """
    trt = _import_tensorrt()
    base = getattr(trt, "IInt8EntropyCalibrator2", None)
    if base is None:
        raise OptpipeError(
            f"TensorRT {trt.__version__} has no INT8 calibrator (removed in TensorRT 11); "
            "use the int8 pass's Q/DQ model, which TensorRT builds with explicit quantization"
        )
    from polygraphy.backend.trt import Calibrator

    cache_path.parent.mkdir(parents=True, exist_ok=True)
    loader = PolygraphyDataLoader(samples, batch_size, input_names)
    return Calibrator(loader, cache=str(cache_path), BaseClass=base)


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise OptpipeError(
            "TensorRT is not installed, so no TensorRT calibrator can be made; install optpipe[tensorrt] on a CUDA machine"
        ) from None
    return trt
