"""Rules about a recipe's stages that need no model run: pass order and the data a pass needs.

Order: `fuse` turns Conv+BN+activation into com.microsoft.FusedConv and attention into
com.microsoft ops. int8 splits FusedConv/FusedGemm back before quantizing (passes/int8.py),
so int8 after fuse works for CNNs and is the right order for transformers (dynamic int8
quantizes fused Attention). Structured pruning reads channel structure from standard ops
only, so it must run before `fuse`: prune after fuse fails on the model, not on the method.
"""
from __future__ import annotations

from optpipe.core.errors import RecipeError
from optpipe.pass_infra.pass_base import Pass
from optpipe.recipe.schema import Recipe, suggest

#: pass -> passes that must not run before it on its path from the root, and why.
MUST_PRECEDE = {
    "prune": {"fuse": "pruning finds channels in standard Conv/MatMul ops, and `fuse` has replaced them with "
                      "com.microsoft fused ops"},
}


def check_stage_rules(recipe: Recipe, passes: dict[str, Pass]) -> None:
    check_order(recipe)
    check_data_needs(recipe, passes)
    check_task(recipe)
    check_decoder_export(recipe, passes)


def check_decoder_export(recipe: Recipe, passes: dict[str, Pass]) -> None:
    """With evaluate.generation the export writes the decoder with its KV cache, and only the dynamo
    exporter can (the cache is a DynamicCache built from flat tensors): an `exporter: torchscript`
    would otherwise be ignored without a word."""
    if recipe.evaluate.generation is None:
        return
    for name, spec in recipe.stages.items():
        if spec.pass_name == "export" and getattr(passes[name].params, "exporter", None) == "torchscript":
            raise RecipeError(f"stages.{name}.params.exporter: a decoder measured by generation (evaluate.generation) is "
                              "exported with its KV cache by the dynamo exporter only; set `exporter: auto` (or dynamo), "
                              "or remove evaluate.generation to export the plain forward with TorchScript")


def check_task(recipe: Recipe) -> None:
    """A language-model task reads its token ids from an input the recipe must have."""
    task = recipe.evaluate.task
    names = [spec.name for spec in recipe.inputs]
    if task is not None and task.kind == "language-model" and task.tokens not in names:
        raise RecipeError(f"evaluate.task.tokens: no input '{task.tokens}'{suggest(task.tokens, names)}; "
                          f"name the input holding the token ids (inputs: {', '.join(names)})")


def check_order(recipe: Recipe) -> None:
    for name, spec in recipe.stages.items():
        forbidden = MUST_PRECEDE.get(spec.pass_name, {})
        for ancestor in _ancestors(recipe, name):
            ancestor_pass = recipe.stages[ancestor].pass_name
            if ancestor_pass in forbidden:
                parent = recipe.stages[ancestor].after
                fix = f"hang it `after: {parent}` and, if you want both, fuse after it" if parent else "run it before fuse"
                raise RecipeError(
                    f"stages.{name}: {spec.pass_name} after {ancestor_pass} (stage '{ancestor}') cannot work: "
                    f"{forbidden[ancestor_pass]}; {fix}"
                )


def check_data_needs(recipe: Recipe, passes: dict[str, Pass]) -> None:
    """A static int8 stage calibrates on `data.calibration`: without it the stage would fail at compile time."""
    if recipe.data.calibration is not None:
        return
    for name, pass_ in passes.items():
        if getattr(pass_, "needs_calibration", False):
            what, fix = getattr(pass_, "calibration_use", ("static int8", "set `params: {mode: dynamic}`"))
            raise RecipeError(
                f"stages.{name}: {what} calibrates on data, and the recipe has no `data.calibration`; "
                f"add `data: {{calibration: {{source: ..., path: ...}}}}` or {fix}"
            )


def _ancestors(recipe: Recipe, name: str) -> list[str]:
    found, seen = [], {name}
    parent = recipe.stages[name].after
    while parent is not None and parent in recipe.stages and parent not in seen:
        found.append(parent)
        seen.add(parent)
        parent = recipe.stages[parent].after
    return found
