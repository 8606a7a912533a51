"""Whether a model's first dim is a batch of independent samples: the model on one sample alone against its row in a
batch. A model that computes across the batch (unbatched attention, a statistic over it), whose output size follows it
(CLIP's image-by-text logits), or that has no output with one row per sample, read "ok" with no word: its figures "at
batch N" were N samples computed together, and Triton's dynamic batching would join users' requests into one
computation (docs/accuracy.md, "Samples in a batch")."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from optpipe.core.errors import RecipeError, first_line
from optpipe.pass_infra.pass_base import PassContext
from optpipe.recipe.schema import ModelInputs
from optpipe.recipe.example_inputs import trace_inputs
from optpipe.evaluation.self_check import load_session


def samples_mixed(run, feeds: dict[str, np.ndarray], together: dict[str, np.ndarray], atol: float, rtol: float,
                  inputs: ModelInputs | None = None) -> dict | None:
    """The model (`run`: eager, or ONNX Runtime on an ONNX source) on the first trace sample alone against its row in
    the trace batch (`together`, at least 2 samples): None where every row-per-sample output matches, else which output
    differs and how (`why`), or that no output is one row per sample. With `inputs` that lead with a fixed length and
    no batch dim, a model that refuses one row of them is refused in one line (`_no_batch`)."""
    size = len(next(iter(feeds.values())))
    if size < 2:
        return None
    try:
        alone = run({name: array[:1] for name, array in feeds.items()})
    except MemoryError:
        raise
    except Exception as exc:  # whatever forward() raises on one row
        if inputs is None or _fixed_first(inputs) is None:
            raise
        raise RecipeError(_no_batch(inputs, exc)) from None
    per_sample = [name for name, value in together.items() if np.ndim(value) and np.shape(value)[0] == size]
    for name in per_sample:
        why = _row_apart(name, np.asarray(alone[name]), np.asarray(together[name]), atol, rtol)
        if why:
            return {"output": name, "why": why}
    if not per_sample:
        shapes = ", ".join(f"'{name}' {list(np.shape(value))}" for name, value in list(together.items())[:2])
        return {"output": None, "why": f"no output has one row per sample ({shapes} at batch {size})"}
    return None


def checked_batch(inputs: ModelInputs) -> bool:
    """Whether the first dim is to be checked as a batch: named for the batch, or a fixed length above 1 that every
    input leads with and no dim names (a fixed batch; or no batch at all, as `_no_batch` tells)."""
    return inputs.batch_dim() is not None or _fixed_first(inputs) is not None


def _no_batch(inputs: ModelInputs, exc: Exception) -> str:
    """Inputs that lead with a fixed length and no batch dim, where the model refuses one row of them: the first dim is
    not a batch. Given `shape: [16]` for a Linear(16), optpipe took 16 samples of one value: its figures read "@ batch
    16" and NNCF's calibration failed ("iteration over a 0-d tensor")."""
    shown = ", ".join(f"'{spec.name}' {list(spec.shape)}" for spec in inputs.inputs)
    one = len(inputs.inputs) == 1
    return (f"inputs: {shown} lead{'s' if one else ''} with a fixed {_fixed_first(inputs)} and no batch dim, and the model "
            f"refuses one row of {'it' if one else 'them'} alone ({first_line(exc)[:100]}): optpipe takes samples along every "
            "input's first dim; give each input a leading batch dim (shape: [batch, ...] with dims.batch), which forward() "
            "must take")


def _fixed_first(inputs: ModelInputs) -> int | None:
    firsts = {spec.shape[0] for spec in inputs.inputs if spec.shape}
    first = firsts.pop() if len(firsts) == 1 else None
    return first if isinstance(first, int) and first > 1 and inputs.batch_dim() is None else None


def _row_apart(name: str, own: np.ndarray, together: np.ndarray, atol: float, rtol: float) -> str | None:
    """How one sample's output alone differs from its row in the batch `together`, or None."""
    row, size = together[:1], len(together)
    if own.ndim != row.ndim:  # a squeeze() that drops the batch dim of one sample
        return f"output '{name}' is {list(own.shape)} for one sample and {list(together.shape)} for {size} (a squeeze() of the batch dim?)"
    if own.shape != row.shape:
        return (f"output '{name}' per sample is {list(own.shape[1:])} alone and {list(row.shape[1:])} in a batch of {size}: "
                "its size follows the batch (one value per pair of samples, as CLIP's image-by-text logits)")
    if own.dtype.kind == "f" and not np.allclose(own, row, atol=atol, rtol=rtol, equal_nan=True):
        apart = float(np.nanmax(np.abs(own.astype(np.float64) - row)))
        return (f"output '{name}' of sample 0 differs by {apart:.3g} when another sample shares its batch: the model "
                "computes across the first dim (attention or recurrence over it, as nn.MultiheadAttention / nn.LSTM do "
                "without batch_first=True; a statistic over the batch)")
    return None


#: An ONNX source this big is not loaded in a session only to check its batch (the preflight's checks ran on it already)
MIXING_CHECK_BYTES = 1 << 30


def onnx_samples_mixed(path: Path, graph, ctx: PassContext) -> dict | None:
    """samples_mixed with ONNX Runtime as the model, on an ONNX source (eager is the model of a PyTorch export): a graph
    whose rows mix the batch's samples is served unbatched by Triton too. Decoders measured by generation, and files
    past MIXING_CHECK_BYTES, are left unchecked. `graph`: the file's graph without its weights, as the import read it."""
    from optpipe.core.runtime import ort_runner
    from optpipe.safety import onnx_guard

    size = sum(f.stat().st_size for f in onnx_guard.model_files(path, graph))
    if not ctx.inputs.batch_dim() or ctx.evaluate.generation is not None or size > MIXING_CHECK_BYTES:
        return None
    feeds = trace_inputs(ctx.inputs)
    try:
        run = ort_runner(load_session(path, ctx.evaluate.threads))
        return samples_mixed(run, feeds, run(feeds), 1e-3, 1e-3)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - ORT's own types; the preflight ran the model on these inputs, so a failure
        return None  # here (a batch of 1 refused by a graph that says otherwise) leaves the check undone, not the import
