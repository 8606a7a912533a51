"""Building the engine on a GPU machine through Polygraphy's loaders, cached by model, plan, TensorRT and GPU."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from optpipe.core.artifact import sha256_json
from optpipe.evaluation.accuracy import quiet_polygraphy
from optpipe.targets.base import TargetJob, hash_files
from optpipe.targets.tensorrt.plan import BuildPlan
from optpipe.targets.tensorrt.probe import TrtFeatures

BUILD_FORMAT = 1


def build_engine(job: TargetJob, plan: BuildPlan, features: TrtFeatures) -> Path:
    """The engine for this plan, from the cache or built through Polygraphy's loaders."""
    import torch

    key = sha256_json({
        "format": BUILD_FORMAT,
        "model": job.stage.result.hash if job.stage.result and job.stage.result.hash else hash_files(job.stage.folder)[1],
        "plan": asdict(plan),
        "tensorrt": features.version,
        "gpu": torch.cuda.get_device_name(0),
    })
    engines = job.cache_dir / "tensorrt" / "engines"
    target = engines / f"{key}.plan"
    if target.is_file():
        return target
    engines.mkdir(parents=True, exist_ok=True)
    tmp = engines / f".{key}.tmp"
    _build_with_polygraphy(job, plan, tmp)
    tmp.replace(target)
    return target


def _build_with_polygraphy(job: TargetJob, plan: BuildPlan, dest: Path) -> None:
    import tensorrt as trt
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        EngineFromBytes,
        NetworkFromOnnxPath,
        Profile,
        SaveEngine,
    )

    quiet_polygraphy()
    timing_cache = job.cache_dir / "tensorrt" / f"timing-{trt.__version__}.cache"
    profile = Profile()
    for name, (low, opt, high) in plan.profile.items():
        profile.add(name, min=low, opt=opt, max=high)
    config_args: dict[str, Any] = {
        "profiles": [profile],
        "load_timing_cache": str(timing_cache) if timing_cache.exists() else None,
        "sparse_weights": plan.sparse_weights or None,
        "builder_optimization_level": plan.builder_optimization_level,
    }
    if plan.workspace_mb:
        config_args["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: plan.workspace_mb << 20}
    # Only set precision flags that exist: CreateConfig fails on flags TensorRT 11 removed.
    for flag in ("fp16", "int8", "tf32"):
        if getattr(plan, flag):
            config_args[flag] = True
    if plan.calibrate:
        config_args["calibrator"] = _calibrator(job, plan)
    network = NetworkFromOnnxPath(str(job.stage.model_path), strongly_typed=plan.strongly_typed or None)
    engine_bytes = EngineBytesFromNetwork(network, config=CreateConfig(**config_args), save_timing_cache=str(timing_cache))
    SaveEngine(EngineFromBytes(engine_bytes), path=str(dest))()


def _calibrator(job: TargetJob, plan: BuildPlan):
    """Polygraphy's calibrator over the cached calibration set; its cache is keyed by model and data,
    since Polygraphy reuses any non-empty cache file without checking what it was made from."""
    from polygraphy.backend.trt import Calibrator

    samples = job.settings.calibration_set()
    model_hash = job.stage.result.hash if job.stage.result else hash_files(job.stage.folder)[1]
    cache = job.cache_dir / "tensorrt" / "calibration" / f"{sha256_json({'model': model_hash, 'data': samples.key})}.cache"
    cache.parent.mkdir(parents=True, exist_ok=True)
    batch = job.settings.evaluate.accuracy_batch if job.settings.shapes.batch_dim() else len(samples)
    return Calibrator(list(samples.batches(batch)), cache=str(cache))
