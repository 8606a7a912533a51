"""The model sources a recipe may name (Hugging Face folder or package, HF config, torchvision,
factory, TorchScript archive, ONNX file), chosen by their distinguishing key."""
from __future__ import annotations

import sys
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)



# Hugging Face tasks, named as Optimum's exporter names them (plus short aliases); each maps to
# a transformers Auto class in optpipe.source.model_source.
HF_TASKS = (
    "feature-extraction", "sequence-classification", "text-classification", "token-classification",
    "question-answering", "fill-mask", "masked-lm", "causal-lm", "text-generation", "seq2seq-lm", "text2text-generation",
    "speech-seq2seq",
    "image-classification", "object-detection", "semantic-segmentation", "audio-classification",
    "multiple-choice", "pretraining", "next-sentence-prediction", "ctc", "audio-frame-classification", "audio-xvector",
    "depth-estimation", "video-classification",
)


class TorchSource(Strict):
    """What every PyTorch model source shares: which of its forward outputs become model outputs."""

    outputs: Optional[list[str]] = Field(
        None, description="forward outputs to keep, by name (a ModelOutput/dict key, or output_0...); default: every tensor"
    )


class HFModel(TorchSource):
    """A Hugging Face model from a local folder, or from a folder inside an installed package."""

    hf: Optional[str] = Field(None, description="local folder with config.json and weights")
    package: Optional[str] = Field(None, description="installed package that ships the model")
    subdir: str = Field("", description="folder inside `package`")
    task: Literal[HF_TASKS] = Field("feature-extraction", description="the head: picks the transformers Auto class")  # type: ignore[valid-type]
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_location(self):
        if (self.hf is None) == (self.package is None):
            raise ValueError("give exactly one of `hf` (a folder) or `package` (an installed package)")
        return self


class TorchvisionModel(TorchSource):
    torchvision: str = Field(description="architecture name, e.g. resnet50 (random weights)")
    num_classes: int = 1000


def standard_library_refusal(spec: str) -> str | None:
    """Why `module:function` may not be a factory, when its module is Python's standard library: a factory
    is called (by compile with the recipe's kwargs, by `optpipe init` without), so `os:system` would run a shell."""
    top = spec.partition(":")[0].split(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":
        return f"'{spec}' is in Python's standard library, not a model; name your own function that builds a torch.nn.Module"
    return None


class FactoryModel(TorchSource):
    factory: str = Field(description="'module:function' returning a torch.nn.Module or (module, example_inputs)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    path: Optional[str] = Field(None, description="folder added to sys.path before importing the module")
    checkpoint: Optional[str] = Field(None, description="weights to load into the module: .safetensors, or a torch.save file")
    allow_pickle: bool = Field(
        False, description="load a torch.save checkpoint with full unpickling (runs code in the file); only for files you trust"
    )

    @field_validator("factory")
    @classmethod
    def _not_the_standard_library(cls, value: str) -> str:
        refusal = standard_library_refusal(value)
        if refusal:
            raise ValueError(refusal)
        return value


class TorchScriptModel(TorchSource):
    """A TorchScript archive (torch.jit.save of a scripted or traced module): the module itself, no code to import."""

    torchscript: str = Field(description="a .pt file torch.jit.save wrote; exported whole by the TorchScript exporter")


class HFConfigModel(TorchSource):
    """A Hugging Face architecture built from its config: random (seeded) weights, for speed rather than accuracy."""

    hf_config: dict[str, Any] = Field(description="`model_type` plus config overrides, e.g. {model_type: bert} for BertConfig()")
    task: Literal[HF_TASKS] = Field("feature-extraction", description="the head: picks the transformers Auto class")  # type: ignore[valid-type]
    tokenizer: Optional[HFModel] = Field(None, description="where a tokenizer for text data lives (hf folder or package)")
    seed: int = Field(0, description="torch seed for the random weights")

    @model_validator(mode="after")
    def _has_model_type(self):
        if "model_type" not in self.hf_config:
            raise ValueError("hf_config needs `model_type` (e.g. bert)")
        return self


class OnnxModel(Strict):
    onnx: str = Field(description="an existing .onnx file; the export stage then imports it as is")
    tokenizer: Optional[HFModel] = Field(
        None, description="where a tokenizer for text data lives (an hf folder, such as the one an Optimum export writes "
        "beside its model.onnx, or a package): an ONNX file carries none")


MODEL_KINDS: dict[str, type[BaseModel]] = {
    "onnx-model": OnnxModel,
    "factory-model": FactoryModel,
    "torchscript-model": TorchScriptModel,
    "torchvision-model": TorchvisionModel,
    "hf-model": HFModel,
    "hf_config-model": HFConfigModel,
}


def _model_kind(value: Any) -> str | None:
    """Pick the model class by its distinguishing key, so errors talk about one kind only."""
    if isinstance(value, BaseModel):
        return next(tag for tag, cls in MODEL_KINDS.items() if isinstance(value, cls))
    if isinstance(value, dict):
        for key in ("onnx", "factory", "torchscript", "torchvision", "hf_config"):
            if key in value:
                return f"{key}-model"
        if "hf" in value or "package" in value:
            return "hf-model"
    return None


ModelSpec = Annotated[
    Union[tuple(Annotated[cls, Tag(tag)] for tag, cls in MODEL_KINDS.items())],  # type: ignore[misc]
    Discriminator(
        _model_kind,
        custom_error_type="model_kind",
        custom_error_message="expected a mapping with one of the keys hf, package, hf_config, torchvision, factory, torchscript "
        "or onnx",
    ),
]


