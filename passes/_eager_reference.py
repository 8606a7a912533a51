"""PyTorch eager's outputs on the trace inputs: the export's yardstick, refused where no export can match it (a
forward() that draws random numbers, a complex output)."""
from __future__ import annotations

import numpy as np

from optpipe.core.errors import ModelSourceError, root_first_line
from optpipe.core.runtime import eager_runner
from optpipe.source.model_source import TorchModel, forward_failure


def eager_outputs(torch_model: TorchModel, feeds: dict[str, np.ndarray], threads: int) -> dict[str, np.ndarray]:
    """PyTorch eager on the trace inputs: the export's yardstick, and the first check that the
    recipe's input specs fit the model."""
    run = eager_runner(torch_model, threads)
    try:
        first, second = run(feeds), run(feeds)
    except MemoryError:  # the machine's limit, not the inputs' fault
        raise
    except Exception as exc:  # whatever forward() raises on inputs it does not accept (at the trace batch)
        raise ModelSourceError(forward_failure(feeds, root_first_line(exc))) from None
    _refuse_random_forward(first, second)
    _refuse_complex(first)
    return first


#: Two eager runs on the same inputs may differ by this share of an output's largest value (threaded reductions)
RANDOM_FORWARD_SHARE = 1e-5


def _refuse_random_forward(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> None:
    """Every stage is measured against eager: a forward that draws random numbers (noise, dropout with
    training=True, sampling) differs from itself, and the export's check failed with 'raise check_atol', which
    cannot help. Refused, with the output and how far two runs differ."""
    for name, value in first.items():
        a, b = np.asarray(value), np.asarray(second[name])
        if a.dtype.kind != "f" or a.shape != b.shape or np.array_equal(a, b, equal_nan=True):
            continue
        apart = float(np.nanmax(np.abs(a.astype(np.float64) - b)))
        if apart > RANDOM_FORWARD_SHARE * max(float(np.nanmax(np.abs(a))), 1e-30):
            raise ModelSourceError(
                f"model: forward() gives different outputs on the same inputs (output '{name}' differs by {apart:.3g} "
                "between two runs): it draws random numbers (noise, dropout with training=True, sampling); every "
                "stage is measured against it, so make forward deterministic for the compile")


def _refuse_complex(outputs: dict[str, np.ndarray]) -> None:
    """ONNX has no complex tensors: the dynamo exporter wrote one as real and imaginary parts in a last dim of 2 (the
    check then blamed the output's shape), and the TorchScript exporter refuses the FFT that made it."""
    for name, value in outputs.items():
        if np.iscomplexobj(value):
            raise ModelSourceError(
                f"model: output '{name}' of forward() is complex ({value.dtype}), which ONNX and its runtimes do not hold: "
                "return torch.view_as_real() of it (real and imaginary parts as a last dim of 2) or the values you use (.abs())")
