"""Progress from inside long work, for `ctx.progress(task, done, total)` (issue 17: no step silent for 10 s).

Three adapters, each on a library's public surface, never a private hook:

- `Steps`: the named steps optpipe itself runs around one library call (load, trace, check, save).
- `printed_progress`: a library that prints its phases (torch.onnx's dynamo exporter with
  `verbose=True` prints "[torch.onnx] Run decompositions..."): stdout is redirected for the call and
  each line with the library's prefix becomes a step; the other lines go to the stage log.
- `logged_progress`: a library that logs its phases on its own logger (onnxslim's "iter: 9",
  "Start shape inference."): for the call the logger sends its records here as steps, not to the
  terminal, and gets its level and propagation back afterwards.
- `counted`: a sequence whose iteration reports each item as it is taken (accuracy batches handed
  to Polygraphy's Comparator, calibration batches): progress from inside the consumer's loop.

The console (instruments.ConsoleProgress) shows the latest step; where one call reports nothing,
its heartbeat shows the running time instead, and says so.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Sequence
from typing import Callable, Iterator, TypeVar

Progress = Callable[[str, int, int], None]
T = TypeVar("T")


def no_progress(task: str, done: int, total: int) -> None:
    pass


class Steps:
    """A job's named steps: `steps("trace")` reports that step n of `total` runs now (n counts from 1).

    `prefix` names the job ("export"), so the console reads `export: trace 2/5`."""

    def __init__(self, progress: Progress, prefix: str, total: int):
        self.progress, self.prefix, self.total = progress, prefix, total
        self.done = 0

    def __call__(self, what: str) -> None:
        self.done += 1
        self.total = max(self.total, self.done)  # an optional step taken: the count stays true
        self.progress(f"{self.prefix}: {what}", self.done, self.total)

    def sub(self, what: str) -> Callable[[int, int], None]:
        """A (done, total) callback for the running step's own counter (batches of a measurement, ...)."""
        return lambda done, total: self.progress(f"{self.prefix}: {what}", done, total)


class _PrintedLines(io.TextIOBase):
    """A stdout stand-in: complete lines starting with `prefix` are steps, every line goes to `log`."""

    def __init__(self, prefix: str | None, on_line: Callable[[str], None], log: logging.Logger | None):
        self.prefix, self.on_line, self.log = prefix, on_line, log
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._take(line)
        return len(text)

    def flush_pending(self) -> None:
        if self._pending:
            self._take(self._pending)
            self._pending = ""

    def _take(self, line: str) -> None:
        if self.log is not None and line.strip():
            self.log.info("%s", line)
        if self.prefix is not None and line.startswith(self.prefix):
            self.on_line(line[len(self.prefix):].strip())


@contextlib.contextmanager
def printed_progress(progress: Progress, task: str, prefix: str | None, log: logging.Logger | None = None) -> Iterator[None]:
    """Inside the block, what the library prints on stdout after `prefix` is the step `task: <text>`
    (prefix None: no line is a step); nothing it prints, on stdout or stderr, reaches the terminal (the stage
    log keeps it: torch.export prints a failed capture's whole FX graph on stderr, dozens of lines between
    optpipe's own, before the exporter moves on). The count is the lines seen (total unknown)."""
    seen = [0]

    def on_line(text: str) -> None:
        seen[0] += 1
        progress(f"{task}: {text[:90]}", seen[0], 0)

    sink, errors = _PrintedLines(prefix, on_line, log), _PrintedLines(None, on_line, log)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(errors):
            yield
    finally:
        sink.flush_pending()
        errors.flush_pending()
        sys.stdout.flush()


@contextlib.contextmanager
def native_stdout_to(log: logging.Logger | None) -> Iterator[None]:
    """Inside the block, what native code writes on file descriptor 1 goes to `log`, line by line, not to the terminal:
    torch's TorchScript exporter prints the whole Torch IR graph there from C++ when a conversion fails ("Torch IR
    graph at exception"), with its log switched on whatever the caller set. Python's own prints are redirected by
    `printed_progress`; optpipe's console writes to stderr, which stays."""
    import os
    import tempfile

    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (a daemon started with it closed): nothing to send to a terminal either
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode("utf-8", "replace").splitlines():
                if log is not None and line.strip():
                    log.info("%s", line)


class _Records(logging.Handler):
    def __init__(self, on_record: Callable[[logging.LogRecord], None]):
        super().__init__(logging.DEBUG)
        self.on_record = on_record

    def emit(self, record: logging.LogRecord) -> None:
        self.on_record(record)


@contextlib.contextmanager
def logged_progress(progress: Progress, task: str, logger_name: str, log: logging.Logger | None = None,
                    level: int = logging.DEBUG) -> Iterator[logging.Logger]:
    """Inside the block, each record of `logger_name` at `level` or above is the step `task: <message>`
    (also kept in `log`), and none propagates to the root's handlers (the terminal). Yields the
    logger; its level, handlers and propagation are as before afterwards, whatever the library set."""
    logger = logging.getLogger(logger_name)
    seen = [0]

    def on_record(record: logging.LogRecord) -> None:
        seen[0] += 1
        message = record.getMessage()
        if log is not None:
            log.debug("%s: %s", logger_name, message)
        progress(f"{task}: {message.splitlines()[0][:90] if message else ''}", seen[0], 0)

    handler = _Records(on_record)
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


class counted(Sequence[T]):
    """`items` as a sequence whose iteration reports `report(n, len)` as item n is taken: the consumer's
    loop (Polygraphy's Comparator over a data loader, ORT's calibration) then is the progress."""

    def __init__(self, items: Sequence[T], report: Callable[[int, int], None] | None):
        self.items, self.report = items, report

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]

    def __iter__(self) -> Iterator[T]:
        total = len(self.items)
        for n, item in enumerate(self.items, start=1):
            if self.report is not None:
                self.report(n, total)
            yield item
