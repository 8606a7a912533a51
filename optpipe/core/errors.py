"""Errors a user can cause, each carrying one sentence that says what to change."""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A C++ source location and function signature (ONNX Runtime puts one before its reason):
# "/onnxruntime_src/.../model_load_utils.h:46 void onnxruntime::...::ValidateOpsetForDomain(...) "
_CPP_LOCATION = re.compile(r"[\w./-]+\.(?:h|hpp|cc|cpp|cu):\d+\s+(?:[^()\n]*\([^()\n]*\)\s*(?:const\s*)?)?")
# OpenVINO's lines before its reason: "Exception from src/...cpp:75:", "Check 'false' failed at src/...cpp:151:",
# "FrontEnd API failed with OpConversionFailure:". Skipped, so the line kept names what went wrong.
_OPENVINO_PREAMBLE = re.compile(r"^(?:Exception from|Check '.*' failed at|FrontEnd API failed with)\b.*:$")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message, without terminal colours."""
    text = _CPP_LOCATION.sub("", _ANSI.sub("", str(exc)))  # so the limit keeps the reason, not the location
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line for line in lines if not _OPENVINO_PREAMBLE.match(line)] or lines
    return reasons[0][:limit] if reasons else type(exc).__name__


def root_first_line(exc: BaseException) -> str:
    """The root cause's first line: exporters wrap the useful message in generic ones ("Failed to export the
    model with torch.export. This is step 1/3 ...")."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return first_line(exc)


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped: a user's key or file name
    must not split the one error line."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


class OptpipeError(Exception):
    """Base of every error optpipe reports to a user as one line (no traceback)."""

    exit_code = 2

    def __init__(self, message: str = "", *args):
        super().__init__(one_line(str(message)), *args)


class UserInputError(OptpipeError):
    """The user's own input is wrong: the recipe, the model it names (a checkpoint that does not fit,
    a forward() that refuses the recipe's inputs) or a data set.

    Raised only where that is known (loading the model, its forward on the recipe's inputs, reading
    data), never guessed from a library's exception class. A stage that meets it fails with
    error_kind "input" (results.StageResult), and a run whose failures are all of that kind ends
    with exit code 2, not 1."""


class RecipeError(UserInputError):
    """The recipe is malformed: the message names the YAML path and what was expected."""


class ModelSourceError(UserInputError):
    """The recipe's model cannot be found or loaded, or its forward() fails on the recipe's inputs."""


class DataError(UserInputError):
    """An evaluation or calibration data set cannot be built or does not fit the model."""


class RunFolderError(OptpipeError):
    """A run folder or stage named on the command line does not exist or holds no report."""


class StageError(OptpipeError):
    """A stage failed while running; other branches of the DAG go on."""

    exit_code = 1

    def __init__(self, stage: str, message: str):
        super().__init__(f"stage '{stage}' failed: {message}")
        self.stage = stage
        self.reason = message


class NonFiniteOutputs(OptpipeError):
    """A stage's model outputs NaN or Inf on the evaluation data: the stage failed (exit 1), since
    the model, not a key of the recipe, is what produced them."""

    exit_code = 1


class PassError(Exception):
    """Raised by a pass when its input or params cannot produce a valid model.

    The pass manager turns it into a StageError naming the stage; the message
    should say what to change.
    """


class PassCrashed(PassError):
    """A pass raised something it did not mean to (a bug), in a stage's worker process: the parent
    reports it as the internal error it was, not as a pass that refused its input."""


class TargetError(OptpipeError):
    """A deployment target (ORT bundle, TensorRT engine, Triton repository) cannot be written as asked."""


class StageTimeout(OptpipeError):
    """A stage ran longer than its `timeout_s`."""

    exit_code = 1

    def __init__(self, stage: str, limit_s: float):
        super().__init__(f"exceeded its time limit of {limit_s:g} s; raise stages.{stage}.timeout_s")


class StageOutOfMemory(OptpipeError):
    """A stage ran out of memory (a MemoryError, or its worker process was killed)."""

    exit_code = 1


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a run; the message says what the cache kept."""
