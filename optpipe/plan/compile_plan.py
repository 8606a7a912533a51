"""The resolved plan of one compile: what every layer below reads of the recipe, made once at the top.

`CompilePlan.of(recipe)` resolves what the layers would otherwise each work out from the whole
Recipe (each stage's parent and its effective tolerance, the model source with the folder its
paths start from); the layers below then take only the typed part they read: a pass its
`PassContext` (model source, evaluation settings, target kinds, tolerance), stage evaluation
`EvaluationParts`, the targets `TargetSettings`, the report builder the name and evaluation
settings. It is plain, validated data (pydantic), so it pickles to a Ray task and round-trips
through JSON to a stage's worker process.

What the plan leaves out is the recipe's alone: the search spaces (a search makes one recipe, so
one plan, per trial), the output and cache paths (`RunPaths`), and the checks on the recipe
itself (`plan/validate.py`, `safety/`), which read the Recipe by design.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict

from optpipe.pass_infra.pass_base import Pass
from optpipe.targets.base import TargetSettings
from optpipe.recipe.schema import DataSets, DimRange, EvaluateSpec, InputSpec, ModelInputs, ModelSource, ModelSpec, Recipe, TargetSpec, Tolerance


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class StagePlan(_Frozen):
    """One stage, resolved: its pass and params, its parent, and the tolerance it is held to."""

    name: str
    pass_name: str
    params: dict[str, Any]
    parent: Optional[str]
    tolerance: Tolerance  # the stage's own, else evaluate's: resolved here, once
    timeout_s: Optional[float] = None
    resources: dict[str, float] = {}


class CompilePlan(_Frozen):
    """What one compile's layers read of the recipe, typed and resolved; see the module docstring."""

    name: str
    model: ModelSpec
    inputs: tuple[InputSpec, ...]
    dims: dict[str, DimRange]
    base_dir: Path
    data: DataSets
    evaluate: EvaluateSpec
    stages: dict[str, StagePlan]
    targets: tuple[TargetSpec, ...] = ()

    @classmethod
    def of(cls, recipe: Recipe) -> "CompilePlan":
        stages = {
            name: StagePlan(name=name, pass_name=spec.pass_name, params=spec.params, parent=spec.after,
                            tolerance=recipe.tolerance_for(name), timeout_s=spec.timeout_s, resources=spec.resources)
            for name, spec in recipe.stages.items()
        }
        return cls(name=recipe.name, model=recipe.model, inputs=tuple(recipe.inputs), dims=dict(recipe.dims),
                   base_dir=recipe.base_dir, data=recipe.data, evaluate=recipe.evaluate, stages=stages,
                   targets=tuple(recipe.targets))

    def configured_pass(self, name: str) -> Pass:
        """The stage's pass with its params, as validation configured it (a task configures only its own)."""
        from optpipe.passes import registry
        from optpipe.plan.validate import configure

        return configure(name, self.stages[name], registry())

    def model_inputs(self) -> ModelInputs:
        return ModelInputs(tuple(self.inputs), dict(self.dims))

    def model_source(self) -> ModelSource:
        return ModelSource(tuple(self.inputs), dict(self.dims), self.model, self.base_dir)

    def parents(self) -> Mapping[str, Optional[str]]:
        return {name: stage.parent for name, stage in self.stages.items()}

    def tolerances(self) -> Mapping[str, Tolerance]:
        return {name: stage.tolerance for name, stage in self.stages.items()}

    def target_kinds(self) -> tuple[str, ...]:
        return tuple(target.kind for target in self.targets)

    def target_settings(self, cache_root: Path) -> TargetSettings:
        """What the targets read, with the run's sample sets (built from the cache when first used)."""
        return TargetSettings.build(self.name, self.evaluate, self.model_source(), self.data, self.parents(), self.tolerances(),
                                    self.targets, cache_root)

    def with_evaluate(self, **changes: Any) -> "CompilePlan":
        """The same plan with some evaluation settings replaced (a scheduled evaluation's reference)."""
        return self.model_copy(update={"evaluate": self.evaluate.model_copy(update=changes)})

    def to_document(self) -> dict[str, Any]:
        """JSON-ready, for a worker process (`from_document` reads it back)."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> "CompilePlan":
        return cls.model_validate(document)
