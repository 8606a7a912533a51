"""The outputs a recipe's task reads (evaluate.task.output), checked against the model's: by the preflight before any
stage runs, and by the task metrics on every evaluation."""
from __future__ import annotations

from optpipe.core.errors import RecipeError
from optpipe.recipe.schema import TaskSpec


def task_outputs(spec: TaskSpec, outputs) -> list[str]:
    """The outputs the task reads (`outputs`: the model's names): its `output`, one or a list, else the first."""
    names = [spec.output] if isinstance(spec.output, str) else list(spec.output or [next(iter(outputs))])
    for name in names:
        if name not in outputs:
            raise RecipeError(f"evaluate.task.output: the model has no output '{name}'; its outputs are {sorted(outputs)}; "
                              "fix the name")
    if len(names) > 1 and spec.kind != "classification":
        raise RecipeError(f"evaluate.task.output: a {spec.kind} task reads one output; a list is for classification "
                          "(a question-answering head's start and end logits)")
    if len(set(names)) != len(names):
        raise RecipeError("evaluate.task.output: list each output once")
    return names
