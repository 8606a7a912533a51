"""How the command line ends when it is stopped or something unexpected happens: one line each.

- Ctrl-C (SIGINT) and SIGTERM both unwind the run as KeyboardInterrupt, so
  `finally` blocks run and the one line says what the cache kept; exit 130 / 143.
- A warning from optpipe (a corrupted cache entry recomputed, a run folder copy
  restored) prints as one `warning:` line.
- A bug (any other exception) prints one line, and its traceback only with OPTPIPE_DEBUG=1.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import click

from optpipe.core.errors import RunInterrupted, first_line

DEBUG_ENV = "OPTPIPE_DEBUG"
_received: list[int] = []


def terminate_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt like SIGINT; both are counted, so a Ctrl-C that a library
    catches and swallows (an exporter falling back to another) is still seen (interrupts_received)."""
    def handler(signum, frame):
        _received.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)


def interrupts_received() -> int:
    """How many SIGINT/SIGTERM this process received since terminate_as_interrupt()."""
    return len(_received)


def interrupted_exit(exc: BaseException | None) -> None:
    message = str(exc) if isinstance(exc, RunInterrupted) else (
        "interrupted: finished stages stay in the cache; rerun the same command to resume"
    )
    click.echo(message, err=True)
    sys.exit(143 if signal.SIGTERM in _received else 130)


def internal_error_exit(exc: Exception) -> None:
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(exc)
    click.echo(
        f"internal error: {type(exc).__name__}: {first_line(exc)} (a bug in optpipe; rerun with {DEBUG_ENV}=1 for the traceback)",
        err=True,
    )
    sys.exit(3)


class _WarningLine(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"warning: {record.getMessage()}", err=True)


def one_line_warnings() -> None:
    """optpipe's warnings (not the stage logs, which go to their files) as `warning:` lines."""
    logger = logging.getLogger("optpipe")
    if not any(isinstance(h, _WarningLine) for h in logger.handlers):
        handler = _WarningLine(level=logging.WARNING)
        logger.addHandler(handler)

