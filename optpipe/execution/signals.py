"""How the command line ends when it is stopped or something unexpected happens: one line each.

- Ctrl-C (SIGINT) and SIGTERM both unwind the run as KeyboardInterrupt, so
  `finally` blocks run and the one line says what the cache kept; exit 130 / 143.
- A warning from optpipe (a corrupted cache entry recomputed, a run folder copy
  restored) prints as one `warning:` line.
- A bug (any other exception) prints one line, and its traceback only with OPTPIPE_DEBUG=1.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback

import click

from optpipe.core.errors import RunInterrupted, first_line

DEBUG_ENV = "OPTPIPE_DEBUG"
_received: list[int] = []
_held_since: dict[int, float] = {}  # signal -> when it was first put off inside an import
_IMPORT_HOLD_S = 30.0


def terminate_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt like SIGINT; both are counted, so a Ctrl-C that a library
    catches and swallows (an exporter falling back to another) is still seen (interrupts_received).
    A signal that arrives while a module is being imported is delivered again once the import is over
    (_redeliver_after_import)."""
    def handler(signum, frame):
        if _redeliver_after_import(signum, frame):
            return
        _received.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = _redeliver_unraisable_interrupt


def _redeliver_unraisable_interrupt(unraisable) -> None:
    """A KeyboardInterrupt raised in a weakref callback, a __del__ or a GC callback cannot propagate:
    Python prints "Exception ignored in ..." with a traceback and goes on, and the run finished with
    exit 0 as if never stopped (measured: a Ctrl-C 3 s into the OpenVINO stage). The signal is sent
    again, to land in code that can unwind; other unraisable errors print as Python prints them."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and _received:
        _send_again(_received[-1])  # from a thread: sent from here, it would raise inside this hook
        return
    sys.__unraisablehook__(unraisable)


def _redeliver_after_import(signum: int, frame) -> bool:
    """Put off a signal that arrived inside an import, by sending it again a moment later.

    Native libraries run Python code from C++ while they are imported (torch's c10d init under
    `import nncf`, in the OpenVINO stage). A KeyboardInterrupt raised there crosses pybind11 where
    nothing catches it, and the process aborts (exit -6, a C++ stack dump) instead of saying what the
    cache kept (measured: a SIGTERM 0.5 s into the OpenVINO stage, CI on x86-amx). Imports are short,
    so the signal is sent again every 0.1 s until the interrupted frame is no longer inside one; one
    held for _IMPORT_HOLD_S (an import that hangs) is raised where it is."""
    if not _inside_import(frame):
        _held_since.pop(signum, None)
        return False
    first = _held_since.setdefault(signum, time.monotonic())
    if time.monotonic() - first > _IMPORT_HOLD_S:
        _held_since.pop(signum, None)
        return False
    _send_again(signum)
    return True


def _send_again(signum: int) -> None:
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def _inside_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def signal_handlers_kept():
    """Keep this process's SIGINT and SIGTERM handlers across a library call that replaces them: ray.init
    in the driver installs its own SIGTERM handlers (a Python one that exits 1 without a word, and its
    core worker's C one that prints a stack dump and aborts, exit -6), where optpipe's say what the cache
    kept and exit 143 (measured, issue 22). Installed again afterwards, which also redoes them in C."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; an API caller elsewhere keeps the library's
        return
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: set outside Python; nothing of ours to put back
                signal.signal(signum, handler)


def interrupts_received() -> int:
    """How many SIGINT/SIGTERM this process received since terminate_as_interrupt()."""
    return len(_received)


def interrupted_exit(exc: BaseException | None) -> None:
    message = str(exc) if isinstance(exc, RunInterrupted) else (
        "interrupted: finished stages stay in the cache; rerun the same command to resume"
    )
    click.echo(message, err=True)
    _forget_unhandled_interrupt()
    if not os.environ.get(DEBUG_ENV):
        # Objects the interrupt left half-built are collected as the interpreter exits, and their
        # __del__ can fail ("Exception ignored in: <function Forward.__del__>", pyparsing's, measured
        # after a SIGTERM in the evaluation): noise after the one line that says what happened.
        sys.unraisablehook = lambda unraisable: None
    sys.exit(143 if signal.SIGTERM in _received else 130)


def _forget_unhandled_interrupt() -> None:
    """CPython marks a KeyboardInterrupt "unhandled" when it leaves code a C extension ran through
    PyRun_String (OpenVINO's bindings do, during its stage), and then ends the process by SIGINT at exit,
    whatever sys.exit said: a Ctrl-C in the OpenVINO stage exited -2, not 130 (measured, issue 22). Every
    PyRun_* call clears that mark before running its code, so running an empty statement through the
    public C API (PyRun_SimpleString) clears it; the Ctrl-C was handled here. Hand-written: Python has
    no other way to say so."""
    if sys.implementation.name != "cpython":
        return
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"pass")
    except Exception:  # no ctypes or no pythonapi (an embedded interpreter): exit as Python decides
        pass


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

