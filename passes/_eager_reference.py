"""PyTorch eager's outputs on the trace inputs: the export's yardstick, refused where no export can match it (a
forward() that draws random numbers, a complex output)."""
from __future__ import annotations

import numpy as np

from optpipe.core.errors import ModelSourceError, root_first_line
from optpipe.core.runtime import as_exported, eager_runner
from optpipe.source.model_source import TorchModel, forward_failure


def eager_outputs(torch_model: TorchModel, feeds: dict[str, np.ndarray], threads: int) -> dict[str, np.ndarray]:
    """PyTorch eager on the trace inputs: the export's yardstick, and the first check that the
    recipe's input specs fit the model."""
    run = eager_runner(torch_model, threads)
    state = _buffer_sums(torch_model.module)
    try:
        with as_exported():
            first, second = run(feeds), run(feeds)
    except MemoryError:  # the machine's limit, not the inputs' fault
        raise
    except Exception as exc:  # whatever forward() raises on inputs it does not accept (at the trace batch)
        raise ModelSourceError(forward_failure(feeds, root_first_line(exc))) from None
    _refuse_random_forward(first, second, [name for name, total in _buffer_sums(torch_model.module).items() if total != state.get(name)])
    _refuse_complex(first)
    return first


#: Two eager runs on the same inputs may differ by this share of an output's largest value (threaded reductions)
RANDOM_FORWARD_SHARE = 1e-5


def _buffer_sums(module) -> dict[str, float]:
    """One number per buffer: enough to tell that forward() wrote to one, without a copy of them all."""
    import torch

    with torch.no_grad():
        return {name: float(buffer.double().sum()) for name, buffer in module.named_buffers() if buffer.is_floating_point()
                or buffer.dtype in (torch.int64, torch.int32)}


def _refuse_random_forward(first: dict[str, np.ndarray], second: dict[str, np.ndarray], written: list[str]) -> None:
    """Every stage is measured against eager: a forward that draws random numbers (noise, dropout with
    training=True, sampling), or that updates state it keeps between calls (`written`: the buffers it wrote, a call
    counter, a streaming cache, batch norm's running statistics in training mode), differs from itself, and the
    export's check failed with 'raise check_atol', which cannot help. Refused, with the output and how far two runs
    differ."""
    for name, value in first.items():
        a, b = np.asarray(value), np.asarray(second[name])
        if a.dtype.kind != "f" or a.shape != b.shape or np.array_equal(a, b, equal_nan=True):
            continue
        apart = float(np.nanmax(np.abs(a.astype(np.float64) - b)))
        if apart > RANDOM_FORWARD_SHARE * max(float(np.nanmax(np.abs(a))), 1e-30):
            cause = (f"it updates state it keeps between calls (buffer {', '.join(repr(b) for b in written[:3])}), which "
                     "an exported graph cannot keep: pass the state in and out as inputs and outputs" if written else
                     "it draws random numbers (noise, dropout with training=True, sampling)")
            raise ModelSourceError(
                f"model: forward() gives different outputs on the same inputs (output '{name}' differs by {apart:.3g} "
                f"between two runs): {cause}; every stage is measured against it, so make forward deterministic for the compile")


def _refuse_complex(outputs: dict[str, np.ndarray]) -> None:
    """ONNX has no complex tensors: the dynamo exporter wrote one as real and imaginary parts in a last dim of 2 (the
    check then blamed the output's shape), and the TorchScript exporter refuses the FFT that made it."""
    for name, value in outputs.items():
        if np.iscomplexobj(value):
            raise ModelSourceError(
                f"model: output '{name}' of forward() is complex ({value.dtype}), which ONNX and its runtimes do not hold: "
                "return torch.view_as_real() of it (real and imaginary parts as a last dim of 2) or the values you use (.abs())")


def samples_mixed(torch_model: TorchModel, feeds: dict[str, np.ndarray], together: dict[str, np.ndarray], threads: int,
                  atol: float, rtol: float) -> dict | None:
    """Whether the first dim is a batch of independent samples: eager on the first trace sample alone against its row
    in the trace batch (`together`, at least 2 samples). None where every row-per-sample output matches. Else what
    differs: an output that mixes samples (attention or recurrence over the first dim, as nn.MultiheadAttention and
    nn.LSTM without batch_first do; a norm over the batch; CLIP's image-by-text logits), or no output that is one row
    per sample at all. Such a model was timed "at batch N" on N samples computed together, and served by Triton with
    dynamic batching, which joins different users' requests into one batch."""
    size = len(next(iter(feeds.values())))
    if size < 2:
        return None
    with as_exported():
        alone = eager_runner(torch_model, threads)({name: array[:1] for name, array in feeds.items()})
    per_sample = [name for name, value in together.items() if np.ndim(value) and np.shape(value)[0] == size]
    for name in per_sample:
        why = _row_apart(name, np.asarray(alone[name]), np.asarray(together[name]), atol, rtol)
        if why:
            return {"output": name, "why": why}
    if not per_sample:
        shapes = ", ".join(f"'{name}' {list(np.shape(value))}" for name, value in list(together.items())[:2])
        return {"output": None, "why": f"no output has one row per sample ({shapes} at batch {size})"}
    return None


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
