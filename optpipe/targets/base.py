"""What every target shares: its typed params, the job it is given, and the result it records.

A target turns one finished stage (its folder under `<run>/stages/<name>/` and its row of
the report) into an artifact a serving stack loads as is. Its result is data
(optpipe.core.results.TargetResult): status ("ok", "skipped", "failed") and the reason apart, the files with their hashes, and the
precision, accuracy and latency that belong to the artifact, with the provider that
measured them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Union

import onnx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from optpipe.core.artifact import DATA_FILE, MODEL_FILE, content_hash, copy_file, sha256_file
from optpipe.core.results import StageResult, TargetResult, TargetStatus
from optpipe.recipe.schema import DataSets, EvaluateSpec, ModelInputs, ModelSource, TargetSpec, Tolerance

if TYPE_CHECKING:
    from optpipe.calibration.dataset import SampleSet


class TargetParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OrtParams(TargetParams):
    ort_format: bool = Field(True, description="also write the ORT format model (model.ort) where the model converts")


class TensorRTParams(TargetParams):
    precision: Literal["auto", "fp32", "fp16", "int8"] = Field(
        "auto",
        description="auto: the graph's own precision (FP16 casts, Q/DQ nodes); fp16/int8 on an FP32 graph need "
        "TensorRT's builder flags (gone in TensorRT 11)",
    )
    sparse_weights: Union[Literal["auto"], bool] = Field("auto", description="auto: on when the weights hold 2:4 patterns")
    workspace_mb: Optional[int] = Field(None, ge=1, description="builder workspace memory pool limit")
    builder_optimization_level: Optional[int] = Field(None, ge=0, le=5)
    tf32: bool = Field(False, description="allow TF32 for FP32 layers (weakly typed networks only)")
    evaluate: bool = Field(True, description="measure the engine's accuracy and latency with Polygraphy's TrtRunner")


class TritonParams(TargetParams):
    platform: Literal["onnxruntime", "tensorrt", "openvino"] = Field(
        "onnxruntime", description="onnxruntime_onnx, tensorrt_plan, or the openvino backend (model.xml)")
    device: Literal["auto", "cpu", "gpu"] = Field("auto", description="instance group kind; auto: the provider that was measured")
    instances: int = Field(1, ge=1, description="model instances per device")
    dynamic_batching: bool = True
    max_queue_delay_us: int = Field(100, ge=0, description="how long Triton may wait to fill a batch")
    max_batch_size: Optional[int] = Field(None, ge=0, description="default: the batch dim's max from the recipe")
    model_name: str = Field("{recipe}_{stage}", description="model folder name; {recipe} and {stage} are filled in")
    backend: Literal["native", "python"] = Field(
        "native", description="native: the platform's own backend (a full Triton image); python: a python-backend model "
        "(model.py) running the same model.onnx/model.xml in ONNX Runtime/OpenVINO with the measured session settings, "
        "for a Triton without those backends (pytriton's tritonserver)")
    text_ensemble: bool = Field(
        False, description="text models: also <name>_text, an ensemble a client sends strings to: the model's tokenizer "
        "(python backend, the tokenizers package) -> the model -> pooling; see docs/serving.md")
    pooling: Literal["auto", "mean", "cls", "none"] = Field(
        "auto", description="the text ensemble's last step: mean over the attention mask, the first token, or none; "
        "auto: the model folder's sentence-transformers 1_Pooling/config.json, else none")

    @model_validator(mode="after")
    def _device_fits_platform(self):
        if self.backend == "python" and self.platform == "tensorrt":
            raise ValueError("backend python runs ONNX Runtime or OpenVINO, not a TensorRT engine; set platform: onnxruntime or openvino")
        if self.backend == "python" and self.device == "gpu":
            raise ValueError("backend python runs on the CPU (ONNX Runtime's CPU provider or OpenVINO's CPU plugin); set device: cpu or auto")
        # Refused at validation (exit 2), not as a failed target after the whole run.
        if self.platform == "openvino" and self.device == "gpu":
            raise ValueError("platform openvino runs on the CPU here (optpipe measures OpenVINO on the CPU); set device: cpu or auto")
        if self.platform == "tensorrt" and self.device == "cpu":
            raise ValueError("platform tensorrt runs on GPUs only; set device: gpu or auto, or platform: onnxruntime")
        return self


class OpenVinoTargetParams(TargetParams):
    evaluate: bool = Field(True, description="measure an IR converted from an ONNX stage on OpenVINO's runtime")


PARAMS: dict[str, type[TargetParams]] = {
    "ort": OrtParams, "tensorrt": TensorRTParams, "triton": TritonParams, "openvino": OpenVinoTargetParams,
}


@dataclass
class StageView:
    """A finished stage as a target sees it: its folder in the run and its row of the report."""

    name: str
    folder: Path
    result: Optional[StageResult] = None

    @property
    def model_path(self) -> Path:
        return self.folder / MODEL_FILE

    @cached_property
    def graph(self) -> onnx.ModelProto:
        """The graph without its weights (cheap): structure, io specs, precision."""
        return onnx.load(str(self.model_path), load_external_data=False)

    @property
    def info(self) -> dict[str, Any]:
        return self.result.info if self.result else {}


@dataclass(frozen=True)
class TargetSettings:
    """What the targets read from the recipe, resolved once at the top (`CompilePlan.target_settings`):
    a target can be built and tested without a Recipe."""

    recipe_name: str
    evaluate: EvaluateSpec
    shapes: ModelInputs
    parents: Mapping[str, Optional[str]]  # each stage's `after`
    tolerances: Mapping[str, Tolerance]  # each stage's own tolerance, else evaluate's
    targets: tuple[TargetSpec, ...] = ()  # all of the recipe's: Triton reuses the tensorrt target's params
    eval_set: Optional[Callable[[], "SampleSet"]] = None
    calibration_set: Optional[Callable[[], "SampleSet"]] = None  # None: the recipe has no `data.calibration`

    def tolerance_for(self, stage: str) -> Tolerance:
        return self.tolerances.get(stage, self.evaluate.tolerance)

    @classmethod
    def build(cls, name: str, evaluate: EvaluateSpec, source: ModelSource, data: DataSets, parents: Mapping[str, Optional[str]],
              tolerances: Mapping[str, Tolerance], targets: tuple[TargetSpec, ...], cache_root: Path) -> "TargetSettings":
        """The settings with the run's sample sets, each built (or read from the cache) when first used."""
        from optpipe.calibration.dataset import build_sample_set

        return cls(
            recipe_name=name, evaluate=evaluate, shapes=source, parents=parents, tolerances=tolerances, targets=targets,
            eval_set=lambda: build_sample_set(data.eval, source, cache_root),
            calibration_set=(lambda: build_sample_set(data.calibration, source, cache_root)) if data.calibration else None,
        )


@dataclass
class TargetJob:
    """Everything one target needs for one stage; the run owns it, the target reads it."""

    settings: TargetSettings
    spec: TargetSpec
    params: TargetParams
    stage: StageView
    out_dir: Path
    root: Path  # paths in results are relative to this (the run or export folder)
    cache_dir: Path
    providers: list[str]
    stage_folder: Callable[[str], Optional[StageView]]  # another stage of the run, by name (ancestors)
    measurer: Optional[Any] = None  # targets.measure.Measurer: eval data and reference outputs, built lazily
    stages_defaulted: bool = False  # stages came from the Pareto frontier, not the recipe
    extras: dict[str, Any] = field(default_factory=dict)

    def result(self, status: TargetStatus, reason: Optional[str] = None, **fields: Any) -> TargetResult:
        return TargetResult(kind=self.spec.kind, stage=self.stage.name, status=status, reason=reason, **fields)


def copy_model(stage: StageView, folder: Path, name: str = MODEL_FILE) -> list[Path]:
    """Copy the stage's model.onnx and its external data into `folder` (the data keeps its name,
    which the ONNX file refers to)."""
    copied = [folder / name]
    copy_file(stage.model_path, folder / name)
    data = stage.folder / DATA_FILE
    if data.exists():
        copy_file(data, folder / DATA_FILE)
        copied.append(folder / DATA_FILE)
    return copied


def hash_files(folder: Path) -> tuple[dict[str, str], str]:
    """sha256 of every file under `folder` (relative paths) and one hash over them."""
    files = {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    return files, content_hash(files)


def relative(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path.resolve())
