"""The recipe's data section: where the evaluation and calibration samples come from."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from optpipe.recipe.model_specs import Strict

MAX_SAMPLES = 100_000  # beyond this a data set's build and every evaluation over it take no useful time


class DataSource(Strict):
    """Where samples come from: synthetic from the input specs, a text file, or arrays."""

    source: Literal["synthetic", "text", "npy", "npz", "images"] = "synthetic"
    path: Optional[str] = None
    samples: int = Field(16, ge=1, le=MAX_SAMPLES)
    seed: int = 0
    preprocess: dict[str, Any] = Field(default_factory=dict, description="images: resize, crop, mean, std, layout")
    labels: Optional[str] = Field(
        None, description="an .npy file of integer labels, one per sample (an npz source may instead hold a `labels` array, "
        "an images folder class subfolders)",
    )

    @model_validator(mode="after")
    def _path_when_needed(self):
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"source '{self.source}' needs a `path`")
        return self


class DataSets(Strict):
    eval: DataSource = Field(default_factory=DataSource)
    calibration: Optional[DataSource] = None
