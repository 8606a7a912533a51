"""What a pass is: a name, a version, typed params, and `run(model, ctx) -> model`.

A pass never mutates its input artifact: it reads `model` and writes a new
artifact into `ctx.workdir`. Everything a pass needs from the run (the typed parts
of the recipe it reads, the source model, data sets, a logger) comes through its
PassContext, never from globals, so a pass can be changed, tested and cached on its own.

The pass manager enforces the contract (optpipe/execution/contract.py): it
publishes the artifact `run` returns, refuses a workdir holding anything but the
model, its external data and info.json, and checks the input is unchanged. The
data sets a pass reads through `ctx.eval_set()` / `ctx.calibration_set()` join
its stage's cache key by themselves (see `PassContext.data_used`).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator

from optpipe.core.artifact import ModelArtifact
from optpipe.recipe.schema import EvaluateSpec, ModelInputs, ModelSource, Tolerance

if TYPE_CHECKING:
    from optpipe.calibration.dataset import SampleSet
    from optpipe.source.model_source import TorchModel


class PassParams(BaseModel):
    """Base of every pass's params: unknown keys are errors, values are typed."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _yaml_booleans_as_modes(cls, data: Any) -> Any:
        """YAML 1.1 reads an unquoted `off`/`no` as false and `on`/`yes` as true: where a field
        expects a string mode that has such a word, take the word the user wrote."""
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if isinstance(value, bool) and field is not None:
                words = ("on", "yes", "true") if value else ("off", "no", "none", "false")
                choice = next((w for w in words if w in _literal_strings(field.annotation)), None)
                if choice:
                    fixed[name] = choice
        return fixed


def _literal_strings(annotation: Any) -> set[str]:
    """The string values a (possibly Optional) Literal annotation accepts."""
    from typing import Literal, Union, get_args, get_origin

    if get_origin(annotation) is Union:
        return set().union(*(_literal_strings(arg) for arg in get_args(annotation)))
    if get_origin(annotation) is Literal:
        return {arg for arg in get_args(annotation) if isinstance(arg, str)}
    return set()


P = TypeVar("P", bound=PassParams)

EVAL_SET = "eval"
CALIBRATION_SET = "calibration"


def _no_progress(task: str, done: int, total: int) -> None:
    pass


class PassContext:
    """The run-scoped services a pass may use, and the typed parts of the recipe it reads.

    A pass is given no Recipe: `model_source` (the model spec, its inputs and dims, the folder
    its paths start from; `inputs` is the inputs and dims alone), `evaluate` (threads, top1,
    accuracy_batch, the task), `target_kinds` (the kinds of target the run emits) and its
    stage's resolved `tolerance` are what passes read of it. They are resolved once, at the
    top (optpipe/plan/compile_plan.py).

    The data sets are read through methods that record each set's key in
    `data_used`: the stage runner adds those keys to the stage's cache key, so a
    pass that reads a data set is recomputed when that set changes, without
    declaring anything.
    """

    def __init__(
        self,
        model_source: ModelSource,
        stage: str,
        workdir: Path,
        log: logging.Logger,
        cache_dir: Path,
        torch_model: Callable[[], "TorchModel"],
        eval_set: Callable[[], "SampleSet"] | None,
        calibration_set: Callable[[], "SampleSet"] | None,
        tolerance: Tolerance,
        evaluate: EvaluateSpec | None = None,
        target_kinds: tuple[str, ...] = (),
        progress: Callable[[str, int, int], None] = _no_progress,
    ):
        self.model_source = model_source
        #: the evaluation settings (threads, top1, accuracy_batch, task); defaults when not given
        self.evaluate = evaluate if evaluate is not None else EvaluateSpec()
        #: the kinds of the run's targets ("ort", "openvino", ...): what a pass may tune for
        self.target_kinds = tuple(target_kinds)
        self.stage = stage
        self.workdir = workdir
        self.log = log
        self.cache_dir = cache_dir
        self.tolerance = tolerance
        #: progress(task, done, total): long work (calibration batches, ...) reports here; instruments show it.
        self.progress = progress
        #: data set name ("eval", "calibration") -> its key, for every set this pass has read.
        self.data_used: dict[str, str] = {}
        self._torch_model = torch_model
        self._sets = {EVAL_SET: eval_set, CALIBRATION_SET: calibration_set}

    @property
    def inputs(self) -> ModelInputs:
        """The model's inputs and the ranges of their named dims (no model spec)."""
        return ModelInputs(self.model_source.inputs, self.model_source.dims)

    def torch_model(self) -> "TorchModel":
        return self._torch_model()

    def eval_set(self) -> "SampleSet":
        return self._data_set(EVAL_SET)

    def calibration_set(self) -> "SampleSet":
        return self._data_set(CALIBRATION_SET)

    def _data_set(self, which: str) -> "SampleSet":
        build = self._sets[which]
        if build is None:
            raise RuntimeError(f"this PassContext has no {which} set")
        samples = build()
        self.data_used[which] = samples.key
        return samples


class Pass(ABC, Generic[P]):
    """Base class of every pass. Subclasses live one per module in `passes/`.

    Write `class MyPass(Pass[MyParams])` and set `Params = MyParams`: `self.params`
    is then typed as MyParams.
    """

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    Params: ClassVar[type[PassParams]] = PassParams
    #: False for passes that start from the recipe's model source rather than a parent stage.
    needs_input: ClassVar[bool] = True
    #: Distributions whose versions shape this pass's output (part of the cache key).
    libraries: ClassVar[tuple[str, ...]] = ("onnx",)
    #: The format of the artifact it writes (execution.contract.FORMAT_FILES); a non-ONNX one ends its branch.
    produces: ClassVar[str] = "onnx"
    #: What to try when the numeric self-check fails (passes whose params inherit SelfCheckParams).
    check_hint: ClassVar[str] = ""
    #: True where the output depends on the CPU's numerics (a guard or an accuracy control decided
    #: it on this CPU, a format picked per ISA): the CPU class as `isa_engine` runs it then joins the
    #: stage's cache key (execution.stage_runner.stage_key), so a shared cache never hands an
    #: AVX2 machine what a VNNI machine decided. "openvino" reads ONEDNN_MAX_CPU_ISA's restriction.
    isa_dependent: ClassVar[bool] = False
    isa_engine: ClassVar[str] = "onnxruntime"

    def __init__(self, params: P):
        self.params: P = params

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    def fingerprint(self, ctx: PassContext) -> dict[str, Any]:
        """Hashes of what the output depends on besides the input model, the params, the pass's
        version and libraries, and the data sets read through `ctx` (those are added by the manager)."""
        return {}

    def skip_reason(self, ctx: PassContext) -> str | None:
        """Why this stage cannot pay on this machine (one line: the measured reason), or None to run it.
        Asked before the cache and the pass: a skipped stage is no failure (the run's exit code stays 0),
        the report shows it with the reason, and the stages after it are skipped with it."""
        return None

    def own_process(self, ctx: PassContext) -> str | None:
        """Why this stage's pass runs in a worker process of its own (one line, recorded in the stage info), or
        None to run it in the compile's process. For a library that keeps what it touched alive after it
        returns: the worker's exit gives all of it back, where the compile's process would carry it under
        every later stage. A stage with `timeout_s` runs in a worker anyway."""
        return None

    @abstractmethod
    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        """Read `model`, write the result into `ctx.workdir`, return it."""
