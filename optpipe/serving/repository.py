"""The Triton repository `optpipe serve` runs: the stages of a finished run as python-backend models.

Written by the Triton target itself (`export_stage` with `backend: python`), so what is served is
what the target deploys: the same model file, dims, max_batch_size and dynamic batching, the
measured session settings. It lives inside the run folder (`<run>/serving/repository`), never
elsewhere. For the load test each stage is also written without dynamic batching (`<name>_nobatch`),
so one server answers both halves of the comparison.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from optpipe.serving.triton_server import ServingError

SERVING_DIR = "serving"
NO_BATCHING_SUFFIX = "_nobatch"


@dataclass(frozen=True)
class ServedModel:
    stage: str
    name: str  # the model's name in Triton
    dynamic_batching: bool
    max_batch_size: int
    runtime: str  # onnxruntime | openvino


def repository_dir(run_dir: Path) -> Path:
    return run_dir / SERVING_DIR / "repository"


def write_serving_repository(run_dir: Path, stages: list[str], without_batching: bool = False) -> tuple[Path, list[ServedModel]]:
    """The repository for `stages` of the run in `run_dir` (written anew: a stale model must not be served)."""
    from optpipe.targets import export_stage

    repository = repository_dir(run_dir)
    if repository.exists():
        shutil.rmtree(repository)
    repository.mkdir(parents=True)
    served = []
    for stage in stages:
        variants = [True, False] if without_batching else [True]
        for batching in variants:
            platform = "openvino" if (run_dir / "stages" / stage / "model.xml").is_file() else "onnxruntime"
            overrides = {"backend": "python", "platform": platform, "device": "cpu", "dynamic_batching": batching,
                         **({} if batching else {"text_ensemble": False}),
                         "model_name": "{recipe}_{stage}" + ("" if batching else NO_BATCHING_SUFFIX)}
            result = export_stage(run_dir, stage, "triton", repository, overrides=overrides)
            if not result.ok:
                raise ServingError(f"stage '{stage}' cannot be served: {result.reason}")
            details = result.details
            served.append(ServedModel(stage, details["model"], batching and details["max_batch_size"] > 0,
                                      details["max_batch_size"], details.get("runtime", platform)))
    (repository / "manifest.json").unlink(missing_ok=True)  # a Triton repository holds model folders only
    return repository, served
