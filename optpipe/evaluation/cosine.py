"""Cosine per row of the last axis, over real tokens only where an attention mask fits: the
measure of `compare`, the task metrics (embeddings) and the layer-wise diff."""
from __future__ import annotations

import numpy as np

MASK_INPUT = "attention_mask"


def real_tokens(inputs) -> np.ndarray | None:
    """The [batch, seq] mask of real tokens among a batch's inputs (None: no mask, every row counts). `attention_mask`
    (1 = a token) as given; else a 2-d integer or boolean input named *mask (an nn.TransformerEncoder's key padding
    mask, 1 / True = padding, or a mask of tokens), read by its data: every sample has a real token and the longest
    has no padding, so the value every row holds is the real one. Where every row holds both, it cannot be told:
    None."""
    if MASK_INPUT in inputs:
        return inputs[MASK_INPUT]
    for name, value in inputs.items():
        value = np.asarray(value)
        if not name.lower().endswith("mask") or value.ndim != 2 or value.dtype.kind not in "biu":
            continue
        ones = value != 0
        every_row_one, every_row_zero = bool(ones.any(axis=1).all()), bool((~ones).any(axis=1).all())
        if every_row_one != every_row_zero:
            return ones if every_row_one else ~ones
    return None


def row_cosines(candidate: np.ndarray, reference: np.ndarray, mask=None) -> np.ndarray:
    """Cosine per row of the last axis (real tokens only where the mask fits), as the tolerance measures it."""
    cand = np.asarray(candidate, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    return cosine_of_rows(np.nan_to_num(rows_of(cand, mask)), rows_of(ref, mask))


def rows_of(array: np.ndarray, mask) -> np.ndarray:
    """[rows, last axis]; with a [batch, seq] mask matching the leading axes, real tokens only."""
    if array.ndim >= 3 and mask is not None and array.shape[:2] == mask.shape:
        return array[mask.astype(bool)].reshape(-1, array.shape[-1])
    if array.ndim == 1:
        return array.reshape(1, -1)
    return array.reshape(-1, array.shape[-1])


def cosine_of_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    dots = np.sum(a * b, axis=-1)
    # Two all-zero rows are identical; one zero row against a non-zero one is not.
    both_zero = norms == 0
    return np.where(both_zero, np.where(np.abs(a - b).sum(-1) == 0, 1.0, 0.0), dots / np.where(both_zero, 1, norms))
