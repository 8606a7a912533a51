"""Keep this thread's alternate signal stack valid after native libraries have used it.

OpenVINO's CPU plugin (2026.4, measured) installs an alternate signal stack (sigaltstack) while
a model is compiled and can leave the thread pointing at that memory after the model is freed.
Python installs its signal handlers with SA_ONSTACK, so the next Ctrl-C is delivered on freed
memory and the process dies of SIGSEGV instead of raising KeyboardInterrupt (seen: the Ctrl-C
tests crashed after the OpenVINO tests in one process). Neither OpenVINO nor Python offers a way
to reset it, so we give the thread a stack of our own through libc, at stage boundaries.
"""
from __future__ import annotations

import ctypes
import sys

_SIZE = 256 * 1024
_SS_ONSTACK = 1
_buffer: ctypes.Array | None = None


class _StackT(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def restore_signal_stack() -> None:
    """Point this thread's alternate signal stack at memory optpipe owns for the whole process."""
    global _buffer
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        current = _StackT()
        if libc.sigaltstack(None, ctypes.byref(current)) != 0 or current.ss_flags & _SS_ONSTACK:
            return  # unknown state, or a handler is running on it right now: leave it alone
        if _buffer is None:
            _buffer = ctypes.create_string_buffer(_SIZE)
        ours = _StackT(ctypes.addressof(_buffer), 0, _SIZE)
        libc.sigaltstack(ctypes.byref(ours), None)
    except (OSError, AttributeError):  # no libc symbol: nothing to repair on this platform
        return
