"""The recipe: YAML validated into typed objects.

Every user mistake becomes a RecipeError whose one line names the YAML path
(`stages.int8.params.method`), what was expected, and the nearest valid key.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Mapping, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from optpipe.core.errors import RecipeError
from optpipe.recipe.generation_spec import GenerationSpec, generation_problem
from optpipe.recipe.search_spec import Choices, SearchSettings, normalize_settings
from optpipe.recipe.task_bounds import TaskBounds, task_bounds_problem

# Beyond this (and data_spec.MAX_SAMPLES) a run does not finish in any useful time (memory: safety/resource_bounds.py).
MAX_ITERATIONS = 100_000
DTYPES = ("float32", "float16", "int64", "int32", "int8", "uint8", "bool")
GPU_PROVIDERS = ("cuda", "tensorrt")  # evaluate.providers that evaluate on a GPU

from optpipe.recipe.data_spec import MAX_SAMPLES, DataSets, DataSource  # noqa: F401  (re-exported)
from optpipe.recipe.error_lines import _suggest, describe_validation_error, suggest  # noqa: F401  (the last two re-exported)
from optpipe.recipe.model_specs import (  # noqa: F401  (re-exported: recipes name these)
    MODEL_KINDS, FactoryModel, HFConfigModel, HFModel, ModelSpec, OnnxModel, Strict, TorchScriptModel, TorchSource,
    TorchvisionModel,
)


# --- inputs, dims, data --------------------------------------------------------------------


class DimRange(Strict):
    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)
    multiple_of: Optional[int] = Field(None, ge=2, description="every size must be a multiple of this (e.g. 32 for a detector's strides)")

    @model_validator(mode="after")
    def _ordered(self):
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"expected min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        for key in ("min", "opt", "max"):
            value = getattr(self, key)
            if not self.allows(value):
                raise ValueError(f"{key} {value} is not a multiple of {self.multiple_of} (multiple_of); use {self.nearest(value)}")
        return self

    def allows(self, value: int) -> bool:
        return self.multiple_of is None or value % self.multiple_of == 0

    def nearest(self, value: int) -> str:
        """The multiples of `multiple_of` around `value`, for error messages."""
        n = self.multiple_of or 1
        below, above = value // n * n, -(-value // n) * n
        return " or ".join(str(v) for v in (below, above) if v >= 1)


class InputSpec(Strict):
    name: str
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    shape: list[Union[int, str]] = Field(description="ints are fixed, strings name a dynamic dim from `dims`")
    range: Optional[tuple[float, float]] = Field(None, description="[low, high) for synthetic values")
    fill: Optional[float] = Field(None, description="constant value for synthetic data (e.g. 1 for masks)", allow_inf_nan=False)

    @field_validator("shape")
    @classmethod
    def _axes_not_empty(cls, shape: list) -> list:
        bad = [d for d in shape if isinstance(d, int) and d < 1]
        if bad:
            raise ValueError(f"an axis of size {bad[0]} holds no values; give sizes >= 1, or a dim name from `dims`")
        return shape

    @field_validator("range")
    @classmethod
    def _low_below_high(cls, value):
        if value is not None and not (math.isfinite(value[0]) and math.isfinite(value[1]) and value[0] < value[1]):
            raise ValueError(f"expected [low, high] with finite low < high, got {list(value)}")
        return value


# --- stages and evaluation -----------------------------------------------------------------


class OutputTolerance(Strict):
    """One output's tolerance; a key left out inherits the stage's (set it to null to switch a check off)."""

    cosine_min: Optional[float] = Field(None, ge=-1, le=1, allow_inf_nan=False)
    max_abs: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="absolute tolerance (atol)")
    rtol: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="relative tolerance: |candidate - reference| <= max_abs + rtol * |reference|")
    top1_min: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)


class Tolerance(Strict):
    # Bounded and finite: a NaN or negative bound would make every comparison pass (the check switched off).
    cosine_min: Optional[float] = Field(0.99, ge=-1, le=1, allow_inf_nan=False, description="per row (per token) cosine to the reference, mean")
    max_abs: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="absolute tolerance (atol), elementwise")
    rtol: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="relative tolerance beside max_abs: |candidate - reference| <= max_abs + rtol * |reference|")
    top1_min: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False, description="top-1 agreement, for logits")
    outputs: dict[str, OutputTolerance] = Field(default_factory=dict, description="per output name: tolerances that replace the ones above")
    task: Optional[TaskBounds] = Field(None, description="a stage's tolerance: its own bounds on evaluate.task's metric")

    def for_output(self, name: str) -> "Tolerance":
        """The tolerance one output is held to: the stage's, with that output's own keys replacing them."""
        own = self.outputs.get(name)
        if own is None:
            return self
        return self.model_copy(update={key: getattr(own, key) for key in own.model_fields_set})


#: Tasks that read the evaluation set's labels (classification: one class per sample; segmentation: per pixel).
LABELLED_TASKS = ("classification", "segmentation")


class TaskSpec(Strict):
    """What the model is for: the stage verdict then uses this task's metric instead of cosine alone."""

    kind: Literal["classification", "detection", "segmentation", "language-model", "embeddings"]
    output: Optional[Union[str, list[str]]] = Field(None, description="the output the task reads (default: the first); classification: a list (a question-answering head's start and end logits) agrees where every one does")
    agreement_min: float = Field(
        0.99, ge=0, le=1, description="classification: top-1 agreement; detection: class agreement on confident "
        "predictions; segmentation: per-pixel class agreement; language-model: next-token top-1 agreement (all against the reference stage)",
    )
    label_drop_max: float = Field(0.01, ge=0, le=1, description="with labels: most top-1 accuracy (segmentation: mIoU) may drop below the reference's")
    score_threshold: float = Field(0.25, gt=0, lt=1, description="detection: a prediction is confident above this score")
    iou_threshold: float = Field(0.45, gt=0, lt=1, description="detection: NMS overlap")
    map50_min: float = Field(0.9, ge=0, le=1, description="detection: mAP@0.5 of the NMS'd boxes against the reference's")
    layout: Literal["yolov5", "yolov8"] = Field(
        "yolov5", description="detection: yolov5 = [N, anchors, 4 box + objectness + classes]; yolov8 = [N, 4 + classes, anchors]"
    )
    perplexity_ratio_max: float = Field(1.05, ge=1, description="language-model: most the perplexity may grow, as a ratio to the reference's")
    tokens: str = Field("input_ids", description="language-model: the input holding the token ids")
    cosine_min: float = Field(0.99, ge=-1, le=1, allow_inf_nan=False, description="embeddings: mean token cosine")

    def bounded(self, bounds: TaskBounds | None) -> "TaskSpec":
        """This task with a stage's own bounds (tolerance.task) in place of its own."""
        return self.model_copy(update=bounds.model_dump(exclude_none=True)) if bounds else self


# A Ray resource amount: finite and >= 0. NaN passed validation and the local executor, then crashed
# Ray's scheduler (`cannot convert float NaN to integer`, exit 3); a negative one Ray refuses too.
ResourceAmount = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class StageSpec(Strict):
    pass_name: str = Field(alias="pass")
    params: dict[str, Any] = Field(default_factory=dict)
    after: Optional[str] = None
    tolerance: Optional[Tolerance] = None
    timeout_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    search: dict[str, Choices] = Field(default_factory=dict, description="params to search: a list of choices, or {min, max, step}")
    optional: bool = Field(False, description="search: try the search with and without this stage")
    resources: dict[str, ResourceAmount] = Field(
        default_factory=dict, description="--executor ray: what the pass's task needs: CPU, GPU, or a custom resource such as a GPU type"
    )

    @field_validator("search")
    @classmethod
    def _choices_not_empty(cls, value: dict):
        empty = [name for name, choices in value.items() if isinstance(choices, list) and not choices]
        if empty:
            raise ValueError(f"search.{empty[0]}: no choices; list at least one value")
        return value


class EvaluateSpec(Strict):
    reference: Optional[str] = Field(None, description="stage whose outputs are the reference; default: the root")
    tolerance: Tolerance = Field(default_factory=Tolerance)
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1], min_length=1)
    warmup: int = Field(5, ge=0, le=MAX_ITERATIONS)
    iterations: int = Field(30, ge=1, le=MAX_ITERATIONS)
    threads: int = Field(2, ge=1)
    accuracy_batch: int = Field(8, ge=1)
    eager_baseline: bool = True
    eager_timing: Literal["auto", "interleaved", "apart"] = Field(
        "auto", description="how PyTorch eager is timed against each stage: interleaved (its model held beside the stage's "
        "runtime, their calls alternating: both figures from the same seconds), apart (its model loaded again once the "
        "stage's runtime is released, and timed right after it: one copy of the weights in memory at a time); auto: "
        "interleaved where the two fit this machine's memory (the memory preflight's estimate), apart where they would not")
    top1: Optional[bool] = Field(None, description="compare argmax of outputs; default: outputs named *logits*")
    task: Optional[TaskSpec] = Field(None, description="what the model is for; the stage verdict then uses the task's metric")
    generation: Optional[GenerationSpec] = Field(None, description="language-model task: KV-cache export, every stage measured by generation")
    min_input_sensitivity: float = Field(
        1e-3, ge=0, description="outputs whose spread across samples is below this fraction of their magnitude make "
        "the accuracy figures meaningless: the report says so",
    )
    sweep: dict[str, Union[list[int], Literal["pow2"]]] = Field(
        default_factory=dict,
        description="latency per value of a named dim, e.g. {batch: pow2, sequence: [16, 64, 256]}; "
        "pow2 = powers of two from the dim's min to its max; other dims stay at `opt`, the batch at batch_sizes[0]",
    )
    sweep_iterations: Optional[int] = Field(None, ge=1, le=MAX_ITERATIONS, description="timed iterations per sweep point; default: iterations")
    sweep_stages: Literal["frontier", "all"] = Field(
        "frontier", description="which stages get the sweep curves: the Pareto frontier's (with the eager baseline), or all"
    )
    adaptive: bool = Field(True, description="stop timing once the median's 95% interval is within 3%; iterations is the cap")
    # 3 s: on a quiet machine figures reach ±3% well within it (x86-amx: batch 8 in 15-50 calls of 30-60 ms); on a
    # cloud VM whose timings spread 10-60% (an AVX2 EPYC) batch-8 figures ran to the 50-call cap, 10-12 s each,
    # with the interval no tighter at the end (docs/compile-time.md).
    figure_budget_s: Optional[float] = Field(
        3.0, gt=0, allow_inf_nan=False,
        description="adaptive timing: a figure whose interval is not within ±3% stops once its timed calls took this long "
        "(at 15 calls or more), and the report gives the interval it reached; null: iterations is the only cap")
    search: Optional[SearchSettings] = Field(None, description="strategy and budget for stages that declare `search:`")
    providers: Literal["auto", "cpu", "cuda", "tensorrt"] = Field(
        "auto", description="where stages are evaluated: auto (CUDA where the machine, or the Ray task, has a GPU), cpu, "
        "cuda, tensorrt (ONNX Runtime's TensorRT provider); with --executor ray, cuda and tensorrt ask Ray for a GPU"
    )
    resources: dict[str, ResourceAmount] = Field(
        default_factory=dict, description="--executor ray: what an evaluation task needs besides the node's `benchmark` slot "
        "(GPU, a GPU type); GPU: 1 is implied by providers cuda or tensorrt"
    )

    @field_validator("search", mode="before")
    @classmethod
    def _search_shorthand(cls, value):
        return normalize_settings(value)

    @model_validator(mode="after")
    def _providers_match_resources(self):
        # Ray hides the GPUs from a task that asks for none: CUDA evaluation without a GPU would time the CPU.
        gpus = self.resources.get("GPU")
        if gpus is not None and gpus <= 0 and self.providers in GPU_PROVIDERS:
            raise ValueError(f"resources: GPU={gpus:g} contradicts providers: {self.providers}, which evaluates on a GPU; "
                             "drop the GPU entry or set providers: cpu")
        if gpus and self.providers == "cpu":
            raise ValueError(f"resources: GPU={gpus:g} contradicts providers: cpu (the GPU would sit idle); "
                             "drop the GPU entry or set providers: cuda")
        return self


class TargetSpec(Strict):
    kind: Literal["ort", "tensorrt", "triton", "openvino"]
    stages: list[str] = Field(default_factory=list, description="stages to emit; default: the Pareto frontier")
    params: dict[str, Any] = Field(default_factory=dict)
    gpu_type: Optional[str] = Field(
        None, description="--executor ray: build and time this target only on a node declaring the Ray resource "
        "gpu:<type> (e.g. h200 -> ray start --resources='{\"gpu:h200\": 1}'); implies a GPU")

    @field_validator("gpu_type")
    @classmethod
    def _gpu_type_name(cls, value: Optional[str]):
        if value is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", value.lower()):
            raise ValueError(f"gpu_type '{value}' is not a GPU type name; use letters, digits, '.', '-' or '_' (e.g. h200, l4, a100-80gb)")
        return value.lower() if value is not None else None


# --- the typed parts a layer takes instead of the whole recipe ------------------------------

@dataclass(frozen=True)
class ModelInputs:
    """The model's inputs and the ranges of their named dims: what shapes and synthetic inputs need."""

    inputs: tuple[InputSpec, ...]
    dims: Mapping[str, DimRange]

    def shape_at(self, spec: InputSpec, which: str = "opt", **overrides: int) -> tuple[int, ...]:
        """A concrete shape for an input: each named dim at its min/opt/max unless overridden."""
        return tuple(
            d if isinstance(d, int) else overrides.get(d, getattr(self.dims[d], which)) for d in spec.shape
        )

    def batch_dim(self) -> str | None:
        """The dim that every input has first, if it is dynamic: that is the batch."""
        firsts = {spec.shape[0] for spec in self.inputs if spec.shape}
        if len(firsts) == 1:
            first = firsts.pop()
            return first if isinstance(first, str) else None
        return None

    def sweep_values(self, dim: str, values: list[int] | str) -> list[int]:
        """The values a sweep over `dim` measures (pow2: powers of two from min to max, plus max)."""
        if isinstance(values, list):
            return sorted(set(values))
        rng = self.dims[dim]
        powers = [2**i for i in range(rng.max.bit_length()) if rng.min <= 2**i <= rng.max and rng.allows(2**i)]
        return sorted(set(powers + [rng.max]))


@dataclass(frozen=True)
class ModelSource(ModelInputs):
    """Where the model comes from, with its inputs, and the folder its relative paths start from."""

    model: ModelSpec
    base_dir: Path

    def resolve(self, path: str | None) -> Path | None:
        return resolve_path(self.base_dir, path)


def resolve_path(base_dir: Path, path: str | None) -> Path | None:
    """A path from the recipe, relative to the recipe's folder."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir / p).resolve()


class Recipe(Strict):
    name: str = "model"
    model: ModelSpec
    inputs: list[InputSpec] = Field(min_length=1)
    dims: dict[str, DimRange] = Field(default_factory=dict)
    data: DataSets = Field(default_factory=DataSets)
    stages: dict[str, StageSpec] = Field(min_length=1)
    evaluate: EvaluateSpec = Field(default_factory=EvaluateSpec)
    targets: list[TargetSpec] = Field(default_factory=list)
    output: str = "runs/model"
    cache: Optional[str] = Field(None, description="cache folder; default: $OPTPIPE_CACHE or ~/.cache/optpipe")

    # Where the recipe file lives: relative paths in it resolve against this.
    base_dir: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _dims_are_declared(self):
        for i, spec in enumerate(self.inputs):
            for dim in spec.shape:
                if isinstance(dim, str) and dim not in self.dims:
                    raise ValueError(f"inputs.{i}.shape names dim '{dim}' that `dims` does not define")
        return self

    @model_validator(mode="after")
    def _sweeps_fit_dims(self):
        for dim, values in self.evaluate.sweep.items():
            if dim not in self.dims:
                raise ValueError(f"evaluate.sweep names dim '{dim}' that `dims` does not define{_suggest(dim, self.dims)}")
            rng = self.dims[dim]
            outside = [v for v in (values if isinstance(values, list) else []) if not rng.min <= v <= rng.max]
            if outside:
                raise ValueError(f"evaluate.sweep.{dim}: {outside} outside the dim's range {rng.min}..{rng.max}")
            off_grid = [v for v in (values if isinstance(values, list) else []) if not rng.allows(v)]
            if off_grid:
                raise ValueError(f"evaluate.sweep.{dim}: {off_grid} not a multiple of {rng.multiple_of} (dims.{dim}.multiple_of)")
        batch = self.batch_dim()
        if batch and self.dims[batch].multiple_of:
            off_grid = [b for b in self.evaluate.batch_sizes if not self.dims[batch].allows(b)]
            if off_grid:
                raise ValueError(f"evaluate.batch_sizes: {off_grid} not a multiple of {self.dims[batch].multiple_of} (dims.{batch}.multiple_of)")
        return self

    @model_validator(mode="after")
    def _generation_measurable(self):  # recipe/generation_spec.py: a causal LM, its token input, batch sizes within dims
        spec = self.evaluate.generation
        if spec and (problem := generation_problem(spec, self.evaluate.task, self.model, self.inputs, self.dims)):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _task_bounds_are_read(self):  # recipe/task_bounds.py: a stage's own task bounds need the task that reads them
        bounds = {f"stages.{name}.tolerance.task": spec.tolerance.task for name, spec in self.stages.items() if spec.tolerance}
        bounds["evaluate.tolerance.task"] = self.evaluate.tolerance.task
        if problem := task_bounds_problem(bounds, self.evaluate.task):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _labels_are_read(self):
        # Only a classification task reads labels: without one, a labels file would be loaded and
        # ignored while the user believes top-1 accuracy on it was checked.
        task = self.evaluate.task
        for which in ("eval", "calibration"):
            source = getattr(self.data, which)
            if source is None or not source.labels:
                continue
            if which == "calibration":
                raise ValueError("data.calibration.labels: calibration reads no labels (only the evaluation set's count); "
                                 "move them to data.eval.labels, or remove them")
            if task is None or task.kind not in LABELLED_TASKS:
                now = f"evaluate.task is {task.kind}" if task else "evaluate.task is not set"
                raise ValueError(f"data.eval.labels: only a classification or segmentation task reads labels, and {now}; set "
                                 "`evaluate.task: {kind: classification}` to check top-1 against them, or remove data.eval.labels")
        return self

    def model_inputs(self) -> ModelInputs:
        return ModelInputs(tuple(self.inputs), dict(self.dims))

    def model_source(self) -> ModelSource:
        return ModelSource(tuple(self.inputs), dict(self.dims), self.model, self.base_dir)

    def sweep_values(self, dim: str) -> list[int]:
        return self.model_inputs().sweep_values(dim, self.evaluate.sweep[dim])

    def resolve(self, path: str | None) -> Path | None:
        return resolve_path(self.base_dir, path)

    def root_stages(self) -> list[str]:
        return [name for name, stage in self.stages.items() if stage.after is None]

    def tolerance_for(self, stage: str) -> Tolerance:
        return self.stages[stage].tolerance or self.evaluate.tolerance

    def shape_at(self, spec: InputSpec, which: str = "opt", **overrides: int) -> tuple[int, ...]:
        return self.model_inputs().shape_at(spec, which, **overrides)

    def batch_dim(self) -> str | None:
        return self.model_inputs().batch_dim()
