"""Checks on a recipe beyond its schema: passes exist, params fit them, the DAG is sound."""
from __future__ import annotations

import networkx as nx
from pydantic import ValidationError

from optpipe.plan.dag import build_dag
from optpipe.core.errors import RecipeError
from optpipe.pass_infra.pass_base import Pass
from optpipe.recipe.schema import Recipe, describe_validation_error, suggest
from optpipe.plan.stage_rules import check_stage_rules
from optpipe.targets import validate_targets


def validate_recipe(recipe: Recipe) -> tuple[nx.DiGraph, dict[str, Pass]]:
    """The stage DAG and one configured pass per stage, or a RecipeError naming what to change."""
    from optpipe.passes import registry

    passes = {name: configure(name, spec, registry()) for name, spec in recipe.stages.items()}
    graph = build_dag(recipe.stages)
    for name, spec in recipe.stages.items():
        needs_input = passes[name].needs_input
        if needs_input and spec.after is None:
            raise RecipeError(f"stages.{name}: pass '{spec.pass_name}' transforms a model, so it needs `after: <stage>`")
        if not needs_input and spec.after is not None:
            raise RecipeError(f"stages.{name}: pass '{spec.pass_name}' starts from the recipe's model; remove `after:`")
        # A pass that writes another format than ONNX (openvino: IR) ends its branch.
        if spec.after is not None and passes[spec.after].produces != "onnx":
            raise RecipeError(f"stages.{name}: stage '{spec.after}' produces {passes[spec.after].produces}, which pass "
                              f"'{spec.pass_name}' cannot read; hang it after an ONNX stage")
    reference = recipe.evaluate.reference
    if reference is not None and reference not in recipe.stages:
        raise RecipeError(f"evaluate.reference: unknown stage '{reference}'{suggest(reference, recipe.stages)}")
    for i, target in enumerate(recipe.targets):
        for stage in target.stages:
            if stage not in recipe.stages:
                raise RecipeError(f"targets.{i}.stages: unknown stage '{stage}'{suggest(stage, recipe.stages)}")
    validate_targets(recipe.targets)
    check_stage_rules(recipe, passes)
    return graph, passes


def configure(stage: str, spec, known: dict[str, type[Pass]]) -> Pass:
    """One stage's pass with its params; `spec` is the recipe's StageSpec or the plan's StagePlan (both name pass_name, params)."""
    cls = known.get(spec.pass_name)
    if cls is None:
        raise RecipeError(
            f"stages.{stage}.pass: unknown pass '{spec.pass_name}'{suggest(spec.pass_name, known)}; "
            f"available: {', '.join(known)}"
        )
    try:
        params = cls.Params.model_validate(spec.params)
    except ValidationError as exc:
        raise RecipeError(describe_validation_error(exc, cls.Params, spec.params, prefix=f"stages.{stage}.params")) from None
    return cls(params)
