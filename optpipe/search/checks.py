"""Every searched value checked before anything runs, each refusal naming the line of the user's
recipe to change (`stages.int8.search.method`), never a trial stage it expands into
(`stages.int8__method-kl__per_channel-True.params.method`), which is in no file.

Two checks:
- a stage's params: each combination of its own searched values with its fixed params through
  its pass's Params (pydantic), so a value refused alone (type, range, unknown key) and a value
  refused beside another (prune's `method: 2:4` with `amount: 0.3`) are both found;
- the recipe's other rules (optpipe.plan.validate: data a pass needs, DAG, targets) on the probe
  trials, each searched value once, with a refusal's trial stage named back as the recipe's.
"""
from __future__ import annotations

import itertools
import math
import re
from typing import Any

from pydantic import ValidationError

from optpipe.core.errors import RecipeError
from optpipe.recipe.schema import describe_validation_error
from optpipe.search.space import ENABLED, Dimension, SearchSpace, Trial
from optpipe.plan.validate import validate_recipe

#: A stage whose searched params make more combinations than this has each value checked beside
#: the others' first values only (pydantic takes ~10 µs a combination: this bounds it to ~1 s);
#: a combination refused beyond it is then found by check_trial when the search proposes it,
#: and is a failed trial.
MAX_COMBINATIONS = 100_000


def check_searched_values(space: SearchSpace) -> None:
    """A RecipeError naming `stages.STAGE.search.PARAM` (or `.params.PARAM`) for the first bad value."""
    for stage, dims, schema in _searched_stages(space):
        _check_params(stage, space.recipe.stages[stage].params, dims, schema)
    _check_rules(space)


def check_trial(space: SearchSpace, trial: Trial) -> None:
    """One proposed trial's params (the driver's check of what MAX_COMBINATIONS left unchecked):
    a RecipeError the driver records as the trial's failure."""
    for stage, dims, schema in _searched_stages(space):
        if math.prod(len(d.values) for d in dims) > MAX_COMBINATIONS:
            own = [Dimension(d.stage, d.param, (trial.get(d.key), *d.values)) for d in dims]
            _check_params(stage, space.recipe.stages[stage].params, own, schema, only_first=True)


def _searched_stages(space: SearchSpace):
    """(stage, its searched params, its pass's Params) for each stage with searched params."""
    from optpipe.passes import registry

    known = registry()
    for stage in space.chain:
        dims = [d for d in space.dimensions if d.stage == stage and d.param != ENABLED]
        pass_name = space.recipe.stages[stage].pass_name
        if dims and pass_name in known:  # an unknown pass is validate_recipe's one line
            yield stage, dims, known[pass_name].Params


def _check_params(stage: str, fixed: dict, dims: list[Dimension], schema, only_first: bool = False) -> None:
    combos = [{d.param: d.values[0] for d in dims}] if only_first else _combinations(dims)
    for combo in combos:
        params = {**fixed, **combo}
        try:
            schema.model_validate(params)
        except ValidationError as exc:
            raise RecipeError(_params_refusal(stage, fixed, dims, combo, schema, exc)) from None


def _combinations(dims: list[Dimension]):
    """Every combination of the stage's searched values, or each value beside the others' first."""
    keys = [d.param for d in dims]
    if math.prod(len(d.values) for d in dims) <= MAX_COMBINATIONS:
        for values in itertools.product(*(d.values for d in dims)):
            yield dict(zip(keys, values))
        return
    first = {d.param: d.values[0] for d in dims}
    for dim in dims:
        for value in dim.values:
            yield {**first, dim.param: value}


def _params_refusal(stage: str, fixed: dict, dims: list[Dimension], combo: dict, schema, exc: ValidationError) -> str:
    text = describe_validation_error(exc, schema, {**fixed, **combo}, prefix=f"stages.{stage}.params")
    loc = exc.errors()[0]["loc"]
    field = loc[0] if loc else None
    if field in combo:
        # The value itself is wrong (type, range, unknown choice), or its key is unknown: its own line.
        return text.replace(f"stages.{stage}.params.{field}", f"stages.{stage}.search.{field}", 1)
    # A rule across params (a model validator): name the searched param with another choice
    # accepted here, the one to change, and the values beside it.
    culprit = next((d.param for d in dims if _valid_with_another(combo, d.param, dims, fixed, schema)), None)
    if culprit is None:
        if field is not None:  # a fixed param refused whatever is searched: `params.X` is the user's line
            return text
        culprit = dims[-1].param
    reason = text.split(": ", 1)[1]
    context = _listed(combo, exclude=culprit)
    beside = f" beside {context}" if context else ""
    return f"stages.{stage}.search.{culprit}: choice {combo[culprit]!r} is refused{beside}: {reason}"


def _valid_with_another(combo: dict, param: str, dims: list[Dimension], fixed: dict, schema) -> bool:
    """Whether another choice of `param` (the rest of the combination kept) is accepted."""
    dim = next(d for d in dims if d.param == param)
    for value in dim.values:
        if value == combo[param] and type(value) is type(combo[param]):
            continue
        try:
            schema.model_validate({**fixed, **combo, param: value})
            return True
        except ValidationError:
            continue
    return False


def _listed(combo: dict, exclude: str) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in combo.items() if k != exclude)


def _check_rules(space: SearchSpace) -> None:
    """validate_recipe on the probe trials (each searched value beside the others' first values)."""
    first = {dim.key: dim.values[0] for dim in space.dimensions}
    probes = list(dict.fromkeys(space.trial({**first, dim.key: value}) for dim in space.dimensions for value in dim.values))
    recipe, _ = space.expand(probes)
    try:
        validate_recipe(recipe)
    except RecipeError as exc:
        # A refusal no searched value escapes (a stage without `after:`) is the stage's own line,
        # not the first value's: some probe (every stage on) passing alone shows the refusal is a value's.
        on = [p for p in probes if all(v for k, v in p.values if k.endswith(f".{ENABLED}"))]  # off, a stage passes unchecked
        blame = any(_passes(space, probe) for probe in on[:_MAX_BLAME_PROBES])
        raise RecipeError(_named_back(str(exc), space, probes, first, blame_values=blame)) from None


_MAX_BLAME_PROBES = 200  # validate_recipe takes ~1 ms on a probe: a refusal's wording costs at most ~0.2 s


def _passes(space: SearchSpace, probe: Trial) -> bool:
    try:
        validate_recipe(space.expand([probe])[0])
        return True
    except RecipeError:
        return False


def _named_back(message: str, space: SearchSpace, probes: list[Trial], first: dict[str, Any], blame_values: bool = True) -> str:
    """The refusal with each trial stage's name replaced by its recipe stage's, and its searched value
    (`blame_values`: the value made the refusal; else the stage's own line is named)."""
    origins = _trial_stages(space, probes, first)
    if not blame_values:
        origins = {name: (stage, None) for name, (stage, _) in origins.items()}
    for name in sorted(origins, key=len, reverse=True):  # the longest first: one name may prefix another
        stage, changed = origins[name]
        if changed:  # the searched value's line, in place of the trial stage's param
            line = f"stages.{stage}.search.{changed[0]} (choice {changed[1]!r})"
            message = re.sub(rf"stages\.{re.escape(name)}(\.params)?(\.[\w.]+)?(?=:)", lambda _: line, message)
        else:  # the stage's own line: its key (`.pass`, `.params.X`) kept
            message = re.sub(rf"stages\.{re.escape(name)}(?=[.:])", lambda _: f"stages.{stage}", message)
        message = message.replace(f"'{name}'", f"'{stage}'")
    return message


def _trial_stages(space: SearchSpace, probes: list[Trial], first: dict[str, Any]) -> dict[str, tuple[str, tuple | None]]:
    """Each probe's stage names -> (recipe stage, (param, value) of its own searched value that is not the first)."""
    origins: dict[str, tuple[str, tuple | None]] = {}
    for trial in probes:
        expanded, _ = space.expand([trial])
        for name, spec in expanded.stages.items():
            if name in space.recipe.stages:
                continue
            stage = max((s for s in space.chain if name.startswith(f"{s}__")), key=len)
            own = [d for d in space.dimensions if d.stage == stage and d.param != ENABLED]
            changed = next(((d.param, trial.get(d.key)) for d in own if trial.get(d.key) != first[d.key]), None)
            if changed is None and len(own) == 1:
                changed = (own[0].param, trial.get(own[0].key))
            origins.setdefault(name, (stage, changed))
    return origins
