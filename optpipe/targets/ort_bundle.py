"""ONNX Runtime bundle: the stage's ONNX with its external data, the session settings that were
measured (session.json), and the ORT format model (model.ort) where the model converts.

`load_bundle` (exposed as `optpipe.load`) turns a bundle back into a ready InferenceSession
with those settings.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from optpipe.core.artifact import MODEL_FILE
from optpipe.core.errors import TargetError, first_line
from optpipe.core.runtime import cuda_available, session_options
from optpipe.targets.base import OrtParams, TargetJob, TargetResult, copy_model, hash_files, relative
from optpipe.targets.model_facts import io_specs, precision_of

SETTINGS_FILE = "session.json"
ORT_FILE = "model.ort"
SETTINGS_FORMAT = 1
# The optimization level ort_session() measured every stage with (optpipe.core.runtime).
MEASURED_OPTIMIZATION = "all"
# The ORT converter's own choice: NCHWc layouts bake in one CPU's vector width.
NOT_PORTABLE_OPTIMIZERS = ["NchwcTransformer"]
log = logging.getLogger("optpipe.targets.ort")


def write_bundle(job: TargetJob) -> TargetResult:
    params: OrtParams = job.params  # type: ignore[assignment]
    folder = job.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / ORT_FILE, folder / SETTINGS_FILE):
        stale.unlink(missing_ok=True)
    copy_model(job.stage, folder)
    settings = bundle_settings(job)
    if params.ort_format:
        settings["ort_format"] = convert_to_ort_format(folder, job)
    (folder / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
    genai = genai_files(job, folder)
    files, digest = hash_files(folder)
    stage = job.stage.result
    return job.result(
        "ok",
        path=relative(folder, job.root),
        precision=settings["precision"],
        # The bundle is the stage's model with the settings it was measured with: its numbers are the stage's.
        provider=stage.headline.provider if stage and stage.headline else settings["providers"][0],
        accuracy=stage.accuracy if stage else None,
        latency=stage.latency if stage else [],
        files=files,
        hash=digest,
        details={"providers": settings["providers"], "ort_format": settings.get("ort_format", {}).get("status", "not requested"),
                 **({"genai": genai} if genai else {})},
    )


def genai_files(job: TargetJob, folder: Path) -> dict[str, Any] | None:
    """A decoder's bundle also as ONNX Runtime GenAI loads it (targets/ort_genai.py): an extra, so a failure is said, not raised."""
    from optpipe.targets import ort_genai

    (folder / ort_genai.CONFIG_FILE).unlink(missing_ok=True)
    try:
        return ort_genai.write_genai(folder, job.stage.graph.graph, job.settings.shapes, job.settings.evaluate.threads)
    except Exception as exc:  # noqa: BLE001 - the measured bundle stays deployable without it
        (folder / ort_genai.CONFIG_FILE).unlink(missing_ok=True)
        return {"config": None, "reason": f"genai_config.json could not be written: {type(exc).__name__}: {first_line(exc)}"}


def bundle_settings(job: TargetJob) -> dict[str, Any]:
    inputs, outputs = io_specs(job.stage.graph)
    threads = job.settings.evaluate.threads
    return {
        "format": SETTINGS_FORMAT,
        "stage": job.stage.name,
        "model": MODEL_FILE,
        "providers": list(job.providers),
        "intra_op_num_threads": threads,
        "inter_op_num_threads": 1,
        "execution_mode": "sequential",
        "graph_optimization_level": MEASURED_OPTIMIZATION,
        "precision": precision_of(job.stage.graph),
        "inputs": [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in inputs],
        "outputs": [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in outputs],
    }


def convert_to_ort_format(folder: Path, job: TargetJob) -> dict[str, Any]:
    """Write model.ort through a session's optimized_model_filepath (what ORT's
    convert_onnx_models_to_ort does per file, without its directory walk and printing),
    then check it gives the ONNX model's outputs."""
    import onnxruntime as ort

    target = folder / ORT_FILE
    options = session_options(job.settings.evaluate.threads, MEASURED_OPTIMIZATION)
    options.optimized_model_filepath = str(target)
    options.add_session_config_entry("session.save_model_format", "ORT")
    try:
        ort.InferenceSession(
            str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"], disabled_optimizers=NOT_PORTABLE_OPTIMIZERS
        )
        max_abs = _max_abs_vs_onnx(folder, job)
    except Exception as exc:  # ORT refuses some graphs in its format (size, ops): the ONNX still ships
        target.unlink(missing_ok=True)
        log.info("ORT format conversion of %s failed: %s", job.stage.name, first_line(exc))
        return {"status": f"skipped: does not convert to the ORT format ({first_line(exc)})"}
    return {
        "status": "ok",
        "file": ORT_FILE,
        "optimized_for": "CPUExecutionProvider",
        "graph_optimization_level": MEASURED_OPTIMIZATION,
        "max_abs_vs_onnx": max_abs,
    }


def _max_abs_vs_onnx(folder: Path, job: TargetJob) -> Optional[float]:
    """Largest difference between model.ort and model.onnx on one evaluation batch."""
    if job.measurer is None:
        return None
    onnx_out = load_bundle(folder, format="onnx", providers=["CPUExecutionProvider"], settings=bundle_settings(job))
    ort_out = load_bundle(folder, format="ort", providers=["CPUExecutionProvider"], settings=bundle_settings(job))
    names = [o.name for o in onnx_out.get_outputs()]
    feeds = _check_feeds(job, onnx_out.get_inputs())
    pairs = zip(onnx_out.run(names, feeds), ort_out.run(names, feeds))
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0)) for a, b in pairs)


def _check_feeds(job: TargetJob, inputs) -> dict[str, np.ndarray]:
    """One evaluation batch as the graph's inputs. A decoder's batch holds its token ids only (the
    evaluation generates): the check runs its prefill, an all-ones mask and an empty past. (Without
    this, every decoder's model.ort was removed as "does not convert", which it did.)"""
    from optpipe.evaluation.generation import empty_past
    from optpipe.source.decoder_export import ATTENTION_MASK, INPUT_IDS
    from optpipe.targets.ort_genai import decoder_layout

    feeds = dict(job.measurer.batches[0])
    layout = decoder_layout(job.stage.graph.graph)
    if layout is not None and INPUT_IDS in feeds:
        ids = feeds[INPUT_IDS]
        types = {i.name: i.type for i in inputs}
        past = [p.astype(np.float16) if types.get(name) == "tensor(float16)" else p
                for name, p in zip(layout.past_names, empty_past(layout, ids.shape[0]))]
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids), **dict(zip(layout.past_names, past))}
    wanted = {i.name for i in inputs}
    return {k: v for k, v in feeds.items() if k in wanted}


def load_bundle(path: str | Path, format: str = "auto", providers: list[str] | None = None, settings: dict | None = None):
    """A ready onnxruntime.InferenceSession from a bundle folder (or its session.json).

    format: "onnx", "ort" (model.ort, optimized for the CPU provider) or "auto" (model.ort
    when it exists and the session runs on the CPU provider, else model.onnx).
    providers: default the measured ones that are available here, else the CPU provider.
    """
    import onnxruntime as ort

    folder = Path(path)
    folder = folder.parent if folder.is_file() else folder
    settings = settings or read_settings(folder)
    chosen = providers or available_providers(settings.get("providers", []))
    model = _model_file(folder, settings, format, chosen)
    options = session_options(int(settings.get("intra_op_num_threads", 0)), settings.get("graph_optimization_level", "all"))
    options.inter_op_num_threads = int(settings.get("inter_op_num_threads", 1))
    return ort.InferenceSession(str(model), sess_options=options, providers=chosen)


def read_settings(folder: Path) -> dict[str, Any]:
    path = folder / SETTINGS_FILE
    if not path.is_file():
        raise TargetError(f"'{folder}' is not an optpipe ORT bundle (no {SETTINGS_FILE}); pass the folder an `ort` target wrote")
    return json.loads(path.read_text())


def available_providers(measured: list[str]) -> list[str]:
    """The measured providers this machine has (CUDA only with a device), always ending with CPU."""
    import onnxruntime as ort

    here = set(ort.get_available_providers())
    keep = [p for p in measured if p in here and (p != "CUDAExecutionProvider" or cuda_available())]
    return keep if "CPUExecutionProvider" in keep else keep + ["CPUExecutionProvider"]


def _model_file(folder: Path, settings: dict, format: str, providers: list[str]) -> Path:
    ort_file = folder / settings.get("ort_format", {}).get("file", ORT_FILE)
    if format == "ort":
        if not ort_file.is_file():
            raise TargetError(f"bundle '{folder}' has no {ORT_FILE} (see session.json ort_format); load it with format='onnx'")
        return ort_file
    if format == "auto" and ort_file.is_file() and providers == ["CPUExecutionProvider"]:
        return ort_file
    if format not in ("auto", "onnx"):
        raise TargetError(f"format '{format}' is unknown; use 'onnx', 'ort' or 'auto'")
    return folder / settings.get("model", MODEL_FILE)

