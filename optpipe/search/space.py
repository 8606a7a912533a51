"""A recipe's search space, its trials, and the plain recipe a set of trials expands into.

Every trial becomes ordinary stages of an expanded recipe (its params in the stage's params,
so in its cache key): a rerun reuses finished trials, and widening the space computes only
the new points. The searched stages and their descendants form a chain; each trial is one
copy of that chain, named after its params (`int8-static__method-entropy__percentile-99.9`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from optpipe.core.artifact import sha256_json
from optpipe.plan.dag import build_dag, execution_order
from optpipe.core.errors import RecipeError
from optpipe.recipe.schema import Recipe, StageSpec
from optpipe.recipe.search_spec import choice_values

ENABLED = "enabled"  # the pseudo-param of an optional stage: searched with (True) and without (False)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_MAX_NAME = 120


@dataclass(frozen=True)
class Dimension:
    stage: str
    param: str
    values: tuple[Any, ...]  # a list choice is held as a tuple: a trial is hashable

    @property
    def key(self) -> str:
        return f"{self.stage}.{self.param}"

    def optuna_choices(self) -> list[Any]:
        """The values as Optuna's categorical takes them: it stores only None, bool, int, float and
        str, so a list choice is its JSON text."""
        return [_optuna_value(v) for v in self.values]

    def from_optuna(self, choice: Any) -> Any:
        return next((v for v in self.values if _optuna_value(v) == choice and type(_optuna_value(v)) is type(choice)), choice)


def _optuna_value(value: Any) -> Any:
    return json.dumps(list(value)) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Trial:
    """One point of the space: a value per dimension, in the space's dimension order."""

    values: tuple[tuple[str, Any], ...]  # (dimension key, value)

    def get(self, key: str) -> Any:
        return dict(self.values)[key]

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.values)


class SearchSpace:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.chain = _searched_chain(recipe)
        self.dimensions = [dim for stage in self.chain for dim in _dimensions(recipe, stage)]
        _check(recipe, self.chain, self.dimensions)

    @staticmethod
    def declared(recipe: Recipe) -> bool:
        return any(spec.search or spec.optional for spec in recipe.stages.values())

    @property
    def size(self) -> int:
        """How many distinct points, counted, not listed: a space of 10^8 points is fine for optuna."""
        return math.prod(block.count for block in self._blocks())

    def grid(self) -> Iterator[Trial]:
        """Every distinct point, lazily, in grid order: an optional stage that is off has one point,
        whatever its params (it comes after the stage's points that are on)."""
        for index in range(self.size):
            yield self.point(index)

    def point(self, index: int) -> Trial:
        """The grid's `index`-th point (0-based), without listing the ones before it: a budget's
        seeded sample of a huge grid."""
        if not 0 <= index < self.size:
            raise IndexError(f"point {index} of a space of {self.size}")
        combo = []
        for block in reversed(self._blocks()):  # mixed radix: the last stage varies fastest
            index, digit = divmod(index, block.count)
            combo.append(block[digit])
        return self._joined(reversed(combo))

    def _blocks(self) -> list["_StagePoints"]:
        """Per searched stage, its own distinct points, each a dict of its dimension keys."""
        return [_StagePoints([d for d in self.dimensions if d.stage == stage]) for stage in self.chain]

    def _joined(self, combo) -> Trial:
        values: dict[str, Any] = {}
        for part in combo:
            values.update(part)
        return Trial(tuple((dim.key, values[dim.key]) for dim in self.dimensions))

    def from_optuna(self, params: dict[str, Any]) -> Trial:
        """The trial for an Optuna trial's params (list choices come back as their JSON text)."""
        return self.trial({dim.key: dim.from_optuna(params[dim.key]) for dim in self.dimensions})

    def trial(self, params: dict[str, Any]) -> Trial:
        """The canonical trial for `params`: the params of a stage that is off at their first value."""
        off = {dim.stage for dim in self.dimensions if dim.param == ENABLED and not params[dim.key]}
        return Trial(tuple((dim.key, dim.values[0] if dim.stage in off and dim.param != ENABLED else params[dim.key])
                           for dim in self.dimensions))

    def expand(self, trials: list[Trial]) -> tuple[Recipe, dict[Trial, str | None]]:
        """A plain recipe: the unsearched stages once, the searched chain once per trial.

        Returns it with each trial's last stage (None when every stage of the trial is off
        and the chain starts at the root: nothing to measure).
        """
        recipe = self.recipe
        stages = {name: spec for name, spec in recipe.stages.items() if name not in self.chain}
        leaves: dict[Trial, str | None] = {}
        for trial in trials:
            parent = recipe.stages[self.chain[0]].after
            parts: list[str] = []
            for stage in self.chain:
                spec = recipe.stages[stage]
                if spec.optional and not trial.get(f"{stage}.{ENABLED}"):
                    parts.append(f"{stage}-off")
                    continue
                own = {d.param: trial.get(d.key) for d in self.dimensions if d.stage == stage and d.param != ENABLED}
                parts += [f"{param}-{_text(value)}" for param, value in own.items()]
                copy = spec.model_copy(update={"params": {**spec.params, **own}, "after": parent, "search": {}, "optional": False})
                name = _stage_name(stage, parts)
                if name in stages and not _same(stages[name], copy):
                    # Two values written alike (-0.5 and 0.5, 'a b' and 'a-b'): the name alone would
                    # make two trials one stage, the second's figures read as the first's.
                    name = f"{stage}__t{sha256_json([parent, [[k, repr(v)] for k, v in own.items()]])[:10]}"
                stages[name] = copy
                parent = name
            leaves[trial] = parent
        return recipe.model_copy(update={"stages": stages}), leaves

    def describe(self) -> dict[str, list[Any]]:
        return {dim.key: [list(v) if isinstance(v, tuple) else v for v in dim.values] for dim in self.dimensions}


def _searched_chain(recipe: Recipe) -> list[str]:
    graph = build_dag(recipe.stages)
    searched = [name for name, spec in recipe.stages.items() if spec.search or spec.optional]
    subtree: set[str] = set(searched)
    for name in searched:
        subtree |= set(_descendants(graph, name))
    chain = [name for name in execution_order(graph) if name in subtree]
    for before, after in zip(chain, chain[1:]):
        if recipe.stages[after].after != before:
            raise RecipeError(
                f"stages.{after}: the searched stages and the stages after them must form one chain "
                f"('{after}' hangs off '{recipe.stages[after].after}', not '{before}'); search one branch per recipe"
            )
    return chain


def _descendants(graph, name: str) -> list[str]:
    import networkx as nx

    return list(nx.descendants(graph, name))


def _dimensions(recipe: Recipe, stage: str) -> list[Dimension]:
    spec: StageSpec = recipe.stages[stage]
    dims = [Dimension(stage, ENABLED, (True, False))] if spec.optional else []
    for param, choices in spec.search.items():
        values = tuple(dict.fromkeys(tuple(v) if isinstance(v, list) else v for v in choice_values(choices)))  # order kept, repeats dropped
        dims.append(Dimension(stage, param, values))
    return dims


def _check(recipe: Recipe, chain: list[str], dims: list[Dimension]) -> None:
    for stage in chain:
        if ENABLED in recipe.stages[stage].search:  # the name of the pseudo-param `optional` adds
            raise RecipeError(f"stages.{stage}.search.{ENABLED}: no pass has this param; write `optional: true` "
                              f"to search the stage with and without itself")
    for dim in dims:
        if dim.param in recipe.stages[dim.stage].params:
            raise RecipeError(f"stages.{dim.stage}.search.{dim.param}: also set in params; keep it in one of the two")
    first = recipe.stages[chain[0]] if chain else None
    if first is not None and first.optional and first.after is None and len(chain) > 1:
        raise RecipeError(f"stages.{chain[0]}.optional: '{chain[0]}' makes the model that '{chain[1]}' and the stages "
                          f"after it start from, so it cannot be off; make a later stage optional instead")
    if recipe.evaluate.reference in chain:
        raise RecipeError(f"evaluate.reference: '{recipe.evaluate.reference}' is a searched stage; the reference must be one model")
    for i, target in enumerate(recipe.targets):
        named = [s for s in target.stages if s in chain]
        if named:
            raise RecipeError(f"targets.{i}.stages: '{named[0]}' is searched; leave `stages` empty to emit the search's frontier")


def _text(value: Any) -> str:
    if isinstance(value, tuple):  # a list choice: its items, or `none` for the empty list
        return "-".join(_text(v) for v in value) or "none"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        return "-" + _text(-value)  # the sign kept: -0.5 is not 0.5
    text = _UNSAFE.sub("-", str(value)).strip("-.") or "x"
    return text.replace("..", ".")


def _same(a: StageSpec, b: StageSpec) -> bool:
    """The same stage: same parent, and params equal in value and type (True == 1 in Python)."""
    typed = lambda spec: {k: (type(v), v) for k, v in spec.params.items()}  # noqa: E731
    return a.after == b.after and typed(a) == typed(b)


def _stage_name(stage: str, parts: list[str]) -> str:
    name = "__".join([stage, *parts])
    if len(name) > _MAX_NAME or ".." in name:
        name = f"{stage}__t{sha256_json(parts)[:10]}"
    return name


class _StagePoints:
    """One stage's distinct points, indexed without listing them: its params'
    combinations (in product order, the first param slowest), then, for an optional stage,
    the one point where it is off (its params at their first values)."""

    def __init__(self, dims: list[Dimension]):
        self.switch = next((d for d in dims if d.param == ENABLED), None)
        self.own = [d for d in dims if d.param != ENABLED]
        self.on = math.prod(len(d.values) for d in self.own)

    @property
    def count(self) -> int:  # not __len__: Python's len() stops at 2**63
        return self.on + (1 if self.switch else 0)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        point: dict[str, Any] = {}
        if index == self.on:  # the stage is off
            point[self.switch.key] = False
            point.update({d.key: d.values[0] for d in self.own})
            return point
        if self.switch:
            point[self.switch.key] = True
        for dim in reversed(self.own):
            index, digit = divmod(index, len(dim.values))
            point[dim.key] = dim.values[digit]
        return point
