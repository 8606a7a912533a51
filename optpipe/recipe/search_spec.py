"""The recipe's search settings, as typed objects (pydantic only: recipe.py imports this module).

A stage declares `search: {param: choices}`; choices are a list, or a range with a step
(`{min: 0.1, max: 0.5, step: 0.1}`). `optional: true` searches the stage with and without
itself. `evaluate.search` picks the strategy and the budget.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

#: A grid without a budget that would run more trials than this asks for `--yes` first.
GRID_CONFIRM_LIMIT = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepRange(_Strict):
    """min, min+step, ..., up to max (included when it falls on a step)."""

    min: float = Field(allow_inf_nan=False)
    max: float = Field(allow_inf_nan=False)
    step: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self):
        if self.max < self.min:
            raise ValueError(f"expected min <= max, got {self.min}, {self.max}")
        steps = (self.max - self.min) / self.step
        if steps > 10_000:  # %g: a step of 1e-300 made a 301-digit count
            raise ValueError(f"{steps:.3g} steps is too many (at most 10000); use a larger step")
        return self

    def values(self) -> list[Union[int, float]]:
        count = math.floor((self.max - self.min) / self.step + 1e-9) + 1
        # Rounded to the step's decimals: 0.1 + 2 * 0.1 is 0.30000000000000004 otherwise,
        # which would make a different cache key than the 0.3 a user writes.
        decimals = max(_decimals(self.min), _decimals(self.step))
        values = [round(self.min + i * self.step, decimals) for i in range(count)]
        whole = all(float(v).is_integer() for v in (self.min, self.step))
        return [int(v) for v in values] if whole else values


PLAIN = (str, int, float, bool, type(None))


def _plain(values: list[Any]) -> list[Any]:
    """A choice is a value a stage name and a cache key can carry: a plain value, or a list of
    them for a list param (fp16's op_block_list: the ops kept in float); no mapping, no nesting."""
    if not values:
        raise ValueError("no choices; list at least one value")
    bad = [v for v in values if not (isinstance(v, PLAIN) or isinstance(v, list) and all(isinstance(x, PLAIN) for x in v))]
    if bad:
        raise ValueError(f"choice {bad[0]!r} is not a plain value or a list of them (text, number, true/false, null)")
    return values


def _choices_kind(value: Any) -> str:
    # A mapping is a range, anything else a list: a bad range then says what is wrong with it
    # (`step: Input should be greater than 0`), not that it is no list.
    return RANGE_TAG if isinstance(value, dict) or isinstance(value, StepRange) else LIST_TAG


#: The union's tags: in angle brackets, so the YAML path an error names leaves them out (optpipe.recipe.error_lines).
LIST_TAG, RANGE_TAG = "<choices>", "<range>"
Choices = Annotated[
    Union[Annotated[list[Any], AfterValidator(_plain), Tag(LIST_TAG)], Annotated[StepRange, Tag(RANGE_TAG)]],
    Discriminator(_choices_kind),
]


class SearchSettings(_Strict):
    strategy: Literal["auto", "grid", "optuna"] = Field(
        "auto", description=f"auto: grid when the space has at most {GRID_CONFIRM_LIMIT} points, else optuna"
    )
    sampler: Literal["tpe", "nsga2"] = Field("tpe", description="optuna: TPE or NSGA-II (multi-objective)")
    objectives: list[Literal["latency", "accuracy", "size"]] = Field(
        default_factory=lambda: ["latency", "accuracy"], min_length=1,
        description="optuna: minimise latency (p50, first batch size) and size, maximise accuracy (the task's headline metric where the recipe names a task, else the worst cosine)",
    )
    trials: Optional[int] = Field(None, ge=1, description="budget: at most this many trials")
    wall_time_s: Optional[float] = Field(None, gt=0, description="budget: start no new trial after this many seconds")
    # Optuna's samplers seed numpy, which takes 0 .. 2**32 - 1 only (else an error mid-run).
    seed: int = Field(0, ge=0, le=2**32 - 1, description="sampler seed (and grid order when the budget cuts the grid)")

    @model_validator(mode="after")
    def _unique_objectives(self):
        if len(set(self.objectives)) != len(self.objectives):
            raise ValueError(f"objectives listed twice: {self.objectives}")
        return self

    @model_validator(mode="after")
    def _sampler_needs_optuna(self):
        # A grid samples nothing: a sampler written beside it was ignored without a word.
        if self.strategy == "grid" and "sampler" in self.model_fields_set:
            raise ValueError(f"sampler: {self.sampler} samples only with strategy optuna (a grid runs its points); "
                             "remove sampler, or set strategy: optuna")
        return self


def normalize_settings(value: Any) -> Any:
    """`search: optuna` is short for `search: {strategy: optuna}`."""
    return {"strategy": value} if isinstance(value, str) else value


def choice_values(choices: Choices) -> list[Any]:
    return choices.values() if isinstance(choices, StepRange) else list(choices)


def _decimals(x: float) -> int:
    text = repr(float(x))
    return 0 if "e" in text else len(text.split(".")[1].rstrip("0"))
