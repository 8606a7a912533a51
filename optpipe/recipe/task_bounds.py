"""A stage's own bounds on the recipe's task metric (`tolerance: {task: {...}}` on a stage).

One recipe often holds stages of different precision classes: INT8 weights that should cost under 1%
perplexity and INT4 weights that cannot, beside each other. One recipe-wide bound then either fails
every INT4 stage or lets INT8 slip; a stage's own bound, written beside it with the reason, does neither.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from optpipe.recipe.model_specs import Strict

#: The bounds each task kind reads (optpipe/evaluation/task_metrics.py, generation_eval.py).
READ_BY = {
    "classification": ("agreement_min", "label_drop_max"),
    "segmentation": ("agreement_min", "label_drop_max"),
    "detection": ("agreement_min", "map50_min"),
    "language-model": ("agreement_min", "perplexity_ratio_max"),
    "embeddings": ("cosine_min",),
}


class TaskBounds(Strict):
    """Each key set replaces evaluate.task's for this stage."""

    agreement_min: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)
    label_drop_max: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)
    map50_min: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)
    perplexity_ratio_max: Optional[float] = Field(None, ge=1, allow_inf_nan=False)
    cosine_min: Optional[float] = Field(None, ge=-1, le=1, allow_inf_nan=False)


def own_bounds(bounds: TaskBounds | None) -> dict[str, float]:
    """The keys a stage set in its tolerance.task (what the report names beside its task figures)."""
    return bounds.model_dump(exclude_none=True) if bounds else {}


def task_bounds_problem(bounds: dict[str, TaskBounds | None], task) -> str | None:
    """One line naming the first bound no task reads (no evaluate.task, or a key its kind ignores)."""
    for where, own in bounds.items():
        if own is None:
            continue
        keys = sorted(own_bounds(own))
        if task is None:
            return f"{where}: bounds a task metric, and evaluate.task is not set; set evaluate.task or remove {where}"
        ignored = [key for key in keys if key not in READ_BY[task.kind]]
        if ignored:
            article = "an" if task.kind[0] in "aeiou" else "a"
            return (f"{where}.{ignored[0]}: {article} {task.kind} task does not read it (it reads {', '.join(READ_BY[task.kind])}); "
                    "remove it or use one of those")
    return None
