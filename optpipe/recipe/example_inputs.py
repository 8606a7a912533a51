"""Synthetic inputs made from the input specs (`ModelInputs`): to trace an export, to check a pass
numerically, and as the `synthetic` data source. One place, so the three agree."""
from __future__ import annotations

import numpy as np

from optpipe.core.errors import DataError, first_line
from optpipe.recipe.schema import InputSpec, ModelInputs


def synthetic_inputs(shapes: ModelInputs, seed: int = 0, **dim_overrides: int) -> dict[str, np.ndarray]:
    """One batch of synthetic inputs at the `opt` shape (dims overridable), seeded."""
    rng = np.random.default_rng(seed)
    batch = {}
    for i, spec in enumerate(shapes.inputs):
        try:
            batch[spec.name] = synthetic_array(spec, shapes.shape_at(spec, **dim_overrides), rng)
        except (ValueError, OverflowError) as exc:  # e.g. an integer range holding no integer, a fill the dtype cannot hold
            raise DataError(
                f"data: cannot draw synthetic values for input '{spec.name}' ({first_line(exc)}); fix inputs.{i}.range "
                f"or inputs.{i}.fill for dtype {spec.dtype}"
            ) from None
    return batch


def trace_inputs(shapes: ModelInputs) -> dict[str, np.ndarray]:
    """Inputs for tracing and for the numeric self-check: dynamic dims at `opt`, but never 1 where
    the dim may grow (an exporter specializes a dim it sees as 1)."""
    overrides = {name: (2 if dim.opt == 1 and dim.max > 1 else dim.opt) for name, dim in shapes.dims.items()}
    return synthetic_inputs(shapes, seed=0, **overrides)


def example_inputs(shapes: ModelInputs, batch: int | None = None) -> dict[str, np.ndarray]:
    """Inputs at the `opt` shape, the batch dim set to `batch` when given."""
    batch_dim = shapes.batch_dim()
    overrides = {batch_dim: batch} if batch_dim and batch else {}
    return synthetic_inputs(shapes, seed=0, **overrides)


def synthetic_array(spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if spec.fill is not None:
        return np.full(shape, spec.fill, dtype=spec.dtype)
    if padding_mask_kind(spec) and len(shape) == 2:
        return _padding_mask(spec, shape, rng)
    if spec.dtype in ("int64", "int32", "int8", "uint8"):
        low, high = spec.range or (0, 100)
        return rng.integers(int(low), int(high), size=shape).astype(spec.dtype)
    if spec.dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    low, high = spec.range or (-1.0, 1.0)
    return rng.uniform(low, high, size=shape).astype(spec.dtype)


def padding_mask_kind(spec: InputSpec) -> str | None:
    """"real" for a [batch, sequence] mask of real tokens (attention_mask, mask: 1 = a token), "pad" for one of padding
    (key_padding_mask, pad_mask: 1 / True = padding), None for any other input. By its name and type, and only where its
    values are left to the default bits (no `range` past [0, 2))."""
    name = spec.name.lower()
    if not name.endswith("mask") or len(spec.shape) != 2 or spec.dtype not in ("bool", "int64", "int32", "int8", "uint8"):
        return None
    if spec.range is not None and tuple(spec.range) != (0, 2):
        return None
    return "pad" if "pad" in name else "real"


def _padding_mask(spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Right padding, at least one real token per row, as a tokenizer writes it. Drawn as random bits, a row of padding
    only made attention's softmax 0/0: a faithful export computed NaN there (an nn.TransformerEncoder's check failed at
    sequence 1), and no data has such a row."""
    lengths = rng.integers(1, shape[1] + 1, size=shape[0])
    real = np.arange(shape[1])[None, :] < lengths[:, None]
    return (real if padding_mask_kind(spec) == "real" else ~real).astype(spec.dtype)
