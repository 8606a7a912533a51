"""OpenVINO target: the stage as an IR folder (`model.xml`, `model.bin`, `openvino.json` with the
compile settings it was measured with), and `load_ir` that compiles it back with those settings.

An `openvino` stage (IR already) is copied with its own measurements. An ONNX stage is converted
here (FP32, `openvino.convert_model`) and, since ONNX Runtime measured the stage, the IR is
measured again on OpenVINO's runtime (accuracy against the reference stage, latency per batch
size): the result carries OpenVINO's numbers, never ORT's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from optpipe.core.artifact import copy_file
from optpipe.core.errors import TargetError
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.targets.base import OpenVinoTargetParams, TargetJob, TargetResult, hash_files, relative

DEPLOY_FORMAT = 1


def write_ir(job: TargetJob) -> TargetResult:
    params: OpenVinoTargetParams = job.params  # type: ignore[assignment]
    folder = job.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    settings, measured_here = place_ir(job, folder)
    stage = job.stage.result
    accuracy, latency = (stage.accuracy, stage.latency) if stage and not measured_here else (None, [])
    if measured_here and params.evaluate and job.measurer is not None:
        accuracy, latency = measure_ir(job, folder, settings)
        check_conversion(job, folder, accuracy)
    genai = genai_folder(job, folder, settings)
    files, digest = hash_files(folder)
    return job.result(
        "ok", path=relative(folder, job.root), precision=settings["precision"], provider=ovr.PROVIDER,
        accuracy=accuracy, latency=latency, files=files, hash=digest,
        details={"inference_precision": settings["inference_precision"], "converted_from_onnx": measured_here,
                 **({"genai": genai} if genai else {})},
    )


def genai_folder(job: TargetJob, folder: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """A decoder's IR also as OpenVINO GenAI's stateful form in `folder/genai/` (targets/openvino_genai.py)."""
    from optpipe.targets import openvino_genai

    try:
        return openvino_genai.write_genai(folder / ovr.IR_FILE, folder, job.settings.shapes, settings["config"])
    except Exception as exc:  # noqa: BLE001 - the measured IR stays deployable; the GenAI form is an extra, said why not
        import shutil

        shutil.rmtree(folder / openvino_genai.FOLDER, ignore_errors=True)
        return {"folder": None, "reason": f"the stateful GenAI form could not be written: {type(exc).__name__}: "
                                          f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}


def place_ir(job: TargetJob, folder: Path) -> tuple[dict[str, Any], bool]:
    """The IR into `folder` (copied, or converted from the stage's ONNX) and its deployment settings;
    True when converted here (so the stage's numbers are not the IR's)."""
    source = job.stage.folder
    if ovr.is_ir(source):
        for name in (ovr.IR_FILE, ovr.WEIGHTS_FILE):
            copy_file(source / name, folder / name)
        stage_settings = ovr.read_settings(source)
        precision, hint, converted = stage_settings.get("precision", "fp32"), stage_settings.get("hint", "f32"), False
        names = job.stage.info.get("output_names")
    else:
        try:
            ovr.save_ir(ovr.convert_onnx(job.stage.model_path), folder)
        except Exception as exc:  # the converter raises assorted errors on ops it cannot translate
            raise TargetError(f"OpenVINO cannot convert stage '{job.stage.name}': {ovr.conversion_failure(exc)}") from None
        precision, hint, converted = "fp32", "f32", True
        names = ovr.output_names(job.stage.model_path)
    threads = job.settings.evaluate.threads
    compiled = ovr.compile_model(folder / ovr.IR_FILE, threads, hint)
    facts = ovr.precision_facts(compiled)
    if converted and facts["int8_layers"]:
        # A QDQ stage (the int8 pass) converts to FakeQuantize ops the CPU plugin runs as int8 kernels:
        # the label says what runs, from the runtime's own count, not the converter's default.
        precision = "int8"
    settings = {
        "format": DEPLOY_FORMAT,
        "runtime": ovr.RUNTIME,
        "stage": job.stage.name,
        "model": ovr.IR_FILE,
        "precision": precision,
        "hint": hint,
        "config": ovr.compile_config(threads, hint),
        "output_names": names,
        **facts,
    }
    (folder / ovr.SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
    return settings, converted


def check_conversion(job: TargetJob, folder: Path, accuracy) -> None:
    """The stage held its tolerance in ONNX Runtime; an IR converted from it that does not has had what it
    computes changed (ORT's contrib ops after the fuse pass convert without error, wrongly: a BERT came out
    at cosine 0.69). Failed, not an 'ok' row, and the IR is removed where a deployment could pick it up."""
    stage = job.stage.result
    if accuracy is None or not (stage and stage.accuracy and stage.accuracy.within_tolerance) or accuracy.within_tolerance:
        return
    for name in (ovr.IR_FILE, ovr.WEIGHTS_FILE, ovr.SETTINGS_FILE):
        (folder / name).unlink(missing_ok=True)
    graph = onnx.load(str(job.stage.model_path), load_external_data=False).graph
    contrib = sorted({f"{n.domain}:{n.op_type}" for n in graph.node if n.domain not in ("", "ai.onnx")})
    cause = (f"; its ONNX Runtime-only ops ({', '.join(contrib)}) are the likely cause: convert a stage without them "
             "(e.g. simplify, not fuse)") if contrib else ""
    raise TargetError(f"OpenVINO's conversion of stage '{job.stage.name}' breaks the tolerance the stage held in ONNX Runtime "
                      f"({'; '.join(accuracy.violations)}){cause}")


def measure_accuracy(job: TargetJob, folder: Path, names: list[str] | None):
    """The IR in `folder` (compiled with the deployed settings) against the reference stage."""
    from optpipe.evaluation.accuracy import run_callable

    compiled = ovr.compile_model(folder / ovr.IR_FILE, job.settings.evaluate.threads)
    run = ovr.runner(compiled, names)
    return job.measurer.accuracy(run_callable(run, job.measurer.batches), job.settings.tolerance_for(job.stage.name))


def measure_ir(job: TargetJob, folder: Path, settings: dict[str, Any]):
    from optpipe.evaluation.accuracy import run_callable

    run = ovr.runner(load_ir(folder), settings.get("output_names"))
    tolerance = job.settings.tolerance_for(job.stage.name)
    accuracy = job.measurer.accuracy(run_callable(run, job.measurer.batches), tolerance)
    return accuracy, job.measurer.latency(run, ovr.PROVIDER)


def load_ir(path: str | Path, threads: int | None = None):
    """A compiled OpenVINO model (openvino.CompiledModel) from an IR folder this target wrote,
    with the settings it was measured with (threads, one latency stream, precision hint)."""
    folder = Path(path)
    folder = folder.parent if folder.is_file() else folder
    settings = read_deploy_settings(folder)
    config = dict(settings["config"])
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    return ovr.core().compile_model(str(folder / settings.get("model", ovr.IR_FILE)), "CPU", config)


def read_deploy_settings(folder: Path) -> dict[str, Any]:
    path = folder / ovr.SETTINGS_FILE
    settings = json.loads(path.read_text()) if path.is_file() else {}
    if "config" not in settings:
        raise TargetError(f"'{folder}' is not an optpipe OpenVINO folder (no {ovr.SETTINGS_FILE} with its compile settings); "
                          "pass the folder an `openvino` target or `optpipe export --format openvino` wrote")
    return settings


def ir_io_specs(folder: Path, output_names: list[str] | None = None):
    """Inputs and outputs of the IR in `folder` as model_facts.TensorSpec (outputs by their ONNX names)."""
    from optpipe.targets.model_facts import TensorSpec

    model = ovr.read_model(folder / ovr.IR_FILE)

    def spec(port, name: str) -> TensorSpec:
        dims = tuple(d.get_length() if d.is_static else None for d in port.get_partial_shape())
        return TensorSpec(name, port.get_element_type().to_dtype().name, dims)

    inputs = [spec(p, p.get_any_name()) for p in model.inputs]
    outputs = [spec(p, ovr.pick_name(p, output_names)) for p in model.outputs]
    return inputs, outputs
