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
    check_input_layout(recipe.inputs)
    return graph, passes


def check_input_layout(inputs) -> None:
    """Every input leads with the batch dim where one does. Samples are stacked and fed in batches along each input's
    first dim: an input shared by the whole batch (a 0-d temperature, a [4, 16] codebook) was sliced like the others,
    and every stage failed as an internal error ("Received incompatible shape: (1, 16)", "array is 0-dimensional")."""
    _refuse_batch_behind(inputs)
    batched = [(i, spec) for i, spec in enumerate(inputs) if spec.shape and isinstance(spec.shape[0], str)]
    if not batched:
        return
    first, lead = batched[0][0], batched[0][1]
    for i, spec in enumerate(inputs):
        if spec.shape and (isinstance(spec.shape[0], str) or spec.shape[0] == 1):
            continue  # a dynamic dim, or a fixed batch of one (feeds of one sample fit it)
        what = "is 0-d (one value)" if not spec.shape else f"leads with the fixed size {spec.shape[0]}"
        raise RecipeError(
            f"inputs.{i} ('{spec.name}') {what}, while inputs.{first} ('{lead.name}') leads with the batch dim "
            f"'{lead.shape[0]}': optpipe feeds every input in batches of samples along its first dim; give it that dim "
            "(one row per sample), or make it part of the model (a constant the factory's module holds)")


#: dim names that say "batch": one of them past an input's first dim is a layout optpipe cannot feed
BATCH_NAMES = ("batch", "batch_size")


def _refuse_batch_behind(inputs) -> None:
    """An input laid out [sequence, batch] (nn.LSTM, nn.MultiheadAttention without batch_first): optpipe took the
    sequence for the batch, and measured, timed ("@ batch 1": one time step) and served batches along it, silently."""
    for i, spec in enumerate(inputs):
        behind = next((k for k, dim in enumerate(spec.shape) if k and dim in BATCH_NAMES), None)
        if behind is not None:
            raise RecipeError(
                f"inputs.{i} ('{spec.name}') has the dim '{spec.shape[behind]}' at position {behind}: optpipe takes every "
                "input's first dim as the batch (it feeds, times and serves samples along it); put the batch first, in the "
                "model (batch_first=True on nn.LSTM / nn.GRU / nn.MultiheadAttention / nn.Transformer, or a transpose in "
                "forward()) and in `inputs`")


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
