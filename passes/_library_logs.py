"""Where the quantizers' own log lines go (shared by the int8 and weight_only passes): ONNX Runtime's
quantization code logs advice on the ROOT logger and a line per node on its own loggers; both belong
in the stage log, not on the user's terminal."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def root_logs_to(log: logging.Logger) -> Iterator[None]:
    """ORT's quantizer logs advice on the root logger: keep it in the stage log, off the terminal."""

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # Only the root logger's own records (ORT's), never ours propagating up: no loop.
            if record.name == "root":
                log.log(record.levelno, "onnxruntime.quantization: %s", record.getMessage())

    root = logging.getLogger()
    handler = Forward()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


@contextlib.contextmanager
def warnings_only(logger: logging.Logger) -> Iterator[None]:
    """A library logger that writes a line per node at INFO: keep its warnings only, for the block."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
