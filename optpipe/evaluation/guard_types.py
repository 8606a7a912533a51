"""The accuracy guard's params (shared by every pass that has a guard) and its report (the stage's
`info["guard"]`): plain data, apart from the guard loop in guard.py."""
from __future__ import annotations

from typing import Optional, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

MAX_EXCLUDED_ALIASES = AliasChoices("max_excluded", "max_kept_nodes")  # fp16's old name still reads


class GuardParams(BaseModel):
    """The guard's params, shared by every pass that has one: `class XParams(PassParams, GuardParams)`."""

    model_config = ConfigDict(extra="forbid")

    guard: bool = Field(True, description="keep the worst nodes in float until the stage's tolerance holds")
    exclude: list[str] = Field(
        default_factory=list, validation_alias=AliasChoices("exclude", "node_block_list"), description="node names always kept in float"
    )
    max_excluded: int = Field(
        8, ge=0, validation_alias=MAX_EXCLUDED_ALIASES, description="guard: most nodes it keeps in float"
    )
    rank_samples: int = Field(
        4, ge=1, validation_alias=AliasChoices("rank_samples", "localize_samples"),
        description="guard: evaluation samples used to blame nodes",
    )
    guard_trials: int = Field(16, ge=0, description="guard: most conversions it tries after the first")
    # A safety net: the trial and node limits bound the guard deterministically; a budget in seconds
    # makes the result depend on the machine's load, so it is set where a quiet run never meets it.
    guard_seconds: float = Field(300.0, gt=0, description="guard: time budget; it gives up after the trial that crosses it")


def guard_criteria(ctx) -> dict:
    """What a guard's verdict reads besides the data (`ctx`: the stage's PassContext), for the stage's cache key: the
    tolerance, and where the recipe sets them the task metric and top-1 (a guard that repaired by one task, or
    none, decided another output than it would by another). Unset ones leave the key as it was."""
    criteria = {"tolerance": ctx.tolerance.model_dump(mode="json")}
    evaluate = ctx.evaluate
    if evaluate.task is not None:
        criteria["task"] = evaluate.task.model_dump(mode="json")
    if evaluate.top1 is not None:
        criteria["top1"] = evaluate.top1
    return criteria


def attempt_score(accuracy) -> tuple:
    """How near a guard's try is to holding, to rank tries (higher is nearer; `accuracy`: an Accuracy): within
    tolerance, fewer broken bounds, then the error as the verdict reads it (Accuracy.error: the task's metric where the
    recipe names one, R² where the cosine cannot tell), then the cosine and the largest error. By the cosine alone, a
    regression head's try that lost R² to 0.66 outranked one that held 0.99 at a cosine 1e-6 lower."""
    max_abs = max((o.max_abs for o in accuracy.outputs), default=0.0)
    return (accuracy.within_tolerance, -len(accuracy.violations), -accuracy.error, accuracy.worst_cosine, -max_abs)


class GuardStep(BaseModel):
    """One try: these nodes in float, the figure it gave, and whether the guard kept them."""

    nodes: list[str]
    ops: list[str] = Field(default_factory=list)
    reason: Optional[str] = Field(None, description="why the blame fell on them")
    added_error: Optional[float] = None
    cosine: float
    max_abs: Union[float, str]
    within_tolerance: bool
    bought_cosine: Optional[float] = None
    kept: bool = True
    facts: dict = Field(default_factory=dict, description="what the pass says each node costs when kept in float")


class GuardReport(BaseModel):
    """What the guard did: the stage's `info["guard"]`."""

    enabled: bool
    numerics: str = Field(description="what computed the guard's figure")
    held: bool = Field(description="the final model is within the stage's tolerance under `numerics`")
    cosine: float
    max_abs: Union[float, str]
    violations: list[str] = Field(default_factory=list)
    first: GuardStep = Field(description="the conversion with only the user's exclusions")
    excluded: list[str] = Field(default_factory=list, description="nodes the guard kept in float (the user's not included)")
    steps: list[GuardStep] = Field(default_factory=list, description="every try after the first")
    trials: int = 0
    seconds: float = 0.0
    gave_up: Optional[str] = Field(None, description="why the guard stopped out of tolerance; None when it held")
    unconverted: Optional[str] = Field(None, description="set when every node the pass converts is kept in float")
