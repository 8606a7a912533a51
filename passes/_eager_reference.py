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


def eager_as_exported(torch_model: TorchModel, threads: int):
    """Eager as a runner whose every call runs as exported (runtime.as_exported)."""
    run = eager_runner(torch_model, threads)

    def exported(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with as_exported():
            return run(feeds)

    return exported

