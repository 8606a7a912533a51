"""What a pass is: a name, a version, typed params, and `run(model, ctx) -> model`.

A pass never mutates its input artifact: it reads `model` and writes a new
artifact into `ctx.workdir`. Everything a pass needs from the run (the recipe,
the source model, data sets, a logger) comes through its PassContext, never
from globals, so a pass can be changed, tested and cached on its own.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from optpipe.artifact import ModelArtifact

if TYPE_CHECKING:
    from optpipe.calibration.dataset import SampleSet
    from optpipe.model_source import TorchModel
    from optpipe.recipe import Recipe, Tolerance


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


@dataclass
class PassContext:
    """The run-scoped services a pass may use."""

    recipe: "Recipe"
    stage: str
    workdir: Path
    log: logging.Logger
    cache_dir: Path
    torch_model: Callable[[], "TorchModel"]
    eval_set: Callable[[], "SampleSet"]
    calibration_set: Callable[[], "SampleSet"]
    tolerance: "Tolerance"
    extras: dict[str, Any] = field(default_factory=dict)
    #: progress(task, done, total): long work (calibration batches, ...) reports here; instruments show it.
    progress: Callable[[str, int, int], None] = lambda task, done, total: None


class Pass(ABC):
    """Base class of every pass. Subclasses live one per module in `passes/`."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    Params: ClassVar[type[PassParams]] = PassParams
    #: False for passes that start from the recipe's model source rather than a parent stage.
    needs_input: ClassVar[bool] = True
    #: Distributions whose versions shape this pass's output (part of the cache key).
    libraries: ClassVar[tuple[str, ...]] = ("onnx",)

    def __init__(self, params: PassParams):
        self.params = params

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    def fingerprint(self, ctx: PassContext) -> dict[str, Any]:
        """Hashes of everything besides the input model and params that the output depends on."""
        return {}

    @abstractmethod
    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        """Read `model`, write the result into `ctx.workdir`, return it."""
