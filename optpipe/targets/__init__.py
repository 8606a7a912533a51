"""Deployable artifacts from finished stages: ORT bundles, TensorRT engines, Triton repositories.

`run_targets` runs after the report is built and before it is written (from `compile_recipe`): each recipe target
writes its artifact for each of its stages (default: the Pareto frontier) under
`<run>/targets/<kind>/`, records a TargetResult (status ok / skipped / failed, reason apart) in the
report, and the run folder gets a manifest of every artifact. `export_stage` does the same
later for one stage of a finished run, without recomputing anything.
"""
from __future__ import annotations

import importlib
import json
import logging
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import ValidationError

from optpipe.errors import OptpipeError, RecipeError, TargetError, first_line
from optpipe.instruments import Instrument
from optpipe.recipe import Recipe, TargetSpec, describe_validation_error
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.results import RunReport
from optpipe.targets.base import PARAMS, StageView, TargetJob, TargetParams, TargetResult, TargetSettings
from optpipe.targets.manifest import write_manifest

__all__ = ["run_targets", "target_settings", "write_recipe_snapshot", "export_stage", "validate_targets", "load_recipe_snapshot", "TargetResult", "KINDS"]

# kind -> (module, function); imported when used, so `import optpipe.targets` stays light.
BUILDERS = {
    "ort": ("optpipe.targets.ort_bundle", "write_bundle"),
    "tensorrt": ("optpipe.targets.tensorrt", "build_target"),
    "triton": ("optpipe.targets.triton", "write_repository"),
    "openvino": ("optpipe.targets.openvino", "write_ir"),
}
KINDS = tuple(BUILDERS)
SNAPSHOT_FILE = "recipe.json"
log = logging.getLogger("optpipe.targets")


def validate_targets(recipe: Recipe) -> None:
    """Each target's params against its kind's schema, as a RecipeError naming the YAML path."""
    for index, spec in enumerate(recipe.targets):
        target_params(spec, f"targets.{index}.params")


def target_params(spec: TargetSpec, where: str) -> TargetParams:
    schema = PARAMS[spec.kind]
    try:
        return schema.model_validate(spec.params)
    except ValidationError as exc:
        raise RecipeError(describe_validation_error(exc, schema, spec.params, prefix=where)) from None


def target_settings(recipe: Recipe, cache_root: Path) -> TargetSettings:
    """The parts of the recipe the targets read, resolved once; the sample sets are built when first used."""
    from optpipe.calibration.dataset import build_sample_set

    data, source = recipe.data, recipe.model_source()
    return TargetSettings(
        recipe_name=recipe.name,
        evaluate=recipe.evaluate,
        shapes=source,
        parents={name: stage.after for name, stage in recipe.stages.items()},
        tolerances={name: recipe.tolerance_for(name) for name in recipe.stages},
        targets=tuple(recipe.targets),
        eval_set=lambda: build_sample_set(data.eval, source, cache_root),
        calibration_set=(lambda: build_sample_set(data.calibration, source, cache_root)) if data.calibration else None,
    )


def run_targets(
    settings: TargetSettings,
    report: RunReport,
    run_dir: Path,
    cache,
    providers: str = "auto",
    instruments: Instrument = Instrument(),
) -> list[TargetResult]:
    """Write every target of the recipe for its stages; record the results in `report.targets`.
    The caller writes the recipe snapshot first (`write_recipe_snapshot`)."""
    # Written afresh each run: a model left in the Triton repository by an earlier recipe would be served.
    shutil.rmtree(run_dir / "targets", ignore_errors=True)
    if not settings.targets:
        (run_dir / "manifest.json").unlink(missing_ok=True)
        return []
    from optpipe.runtime import pick_providers
    from optpipe.targets.measure import Measurer

    views = _stage_views(run_dir, report)
    reference = views(report.reference) if report.reference else None
    measurer = Measurer(settings, cache, reference, providers)
    shared: dict[str, Any] = {}
    results: list[TargetResult] = []
    # TensorRT before Triton, so a tensorrt_plan model reuses the engine built in this run.
    for index, spec in sorted(enumerate(settings.targets), key=lambda item: KINDS.index(item[1].kind)):
        params = target_params(spec, f"targets.{index}.params")
        stages = spec.stages or list(report.pareto)
        if not stages:
            results.append(TargetResult(kind=spec.kind, stage="", status="skipped", reason=(
                f"no stage is on the Pareto frontier (none finished within tolerance); name stages in targets.{index}.stages")))
            continue
        for stage in stages:
            instruments.before_target(spec.kind, stage)
            view = views(stage)
            if view is None:
                result = TargetResult(kind=spec.kind, stage=stage, status="skipped", reason=_why_missing(report, stage))
            else:
                job = TargetJob(
                    settings=settings, spec=spec, params=params, stage=view, out_dir=_out_dir(run_dir / "targets", spec.kind, stage),
                    root=run_dir, cache_dir=cache.root, providers=measurer.evaluator.providers, stage_folder=views,
                    measurer=measurer, stages_defaulted=not spec.stages, extras=shared,
                )
                result = run_one(job)
            results.append(result)
            instruments.target_done(result)
    report.targets = results
    write_manifest(run_dir, settings.recipe_name, results)
    return results


def run_one(job: TargetJob) -> TargetResult:
    """One target for one stage; its failure is recorded, never raised, so the other targets go on."""
    module, function = BUILDERS[job.spec.kind]
    refusal = _format_refusal(job)
    if refusal:
        return job.result("skipped", refusal)
    build = getattr(importlib.import_module(module), function)
    try:
        return build(job)
    except OptpipeError as exc:
        return job.result("failed", str(exc))
    except Exception as exc:  # a bug or a library refusing the model must not stop the other targets
        log.debug("target %s for %s failed:\n%s", job.spec.kind, job.stage.name, traceback.format_exc())
        return job.result("failed", f"{job.spec.kind} target error ({type(exc).__name__}: {first_line(exc)})")


def export_stage(
    run_dir: Path,
    stage: str,
    kind: str,
    to: Path,
    cache_dir: Optional[Path] = None,
    providers: str = "auto",
) -> TargetResult:
    """Write one target for one stage of a finished run into `to` (plus a manifest there).

    Reads report.json, recipe.json and the stage's folder; recomputes no stage. The recipe's
    params for that kind of target are used where the recipe has one.
    """
    from optpipe.cache.store import StageCache
    from optpipe.run_paths import RunPaths
    from optpipe.targets.measure import Measurer

    if kind not in BUILDERS:
        raise TargetError(f"--format: unknown format '{kind}'; use one of {', '.join(KINDS)}")
    if not (run_dir / "report.json").is_file():
        raise TargetError(f"'{run_dir}' is not an optpipe run folder (no report.json); pass the folder `optpipe compile` wrote")
    report = RunReport.load(run_dir)
    recipe = load_recipe_snapshot(run_dir)
    views = _stage_views(run_dir, report)
    view = views(stage)
    if view is None:
        raise TargetError(f"--stage: {_why_missing(report, stage)}")
    spec = next((t for t in recipe.targets if t.kind == kind), None) or TargetSpec(kind=kind)
    index = recipe.targets.index(spec) if spec in recipe.targets else 0
    params = target_params(spec, f"targets.{index}.params")
    cache = StageCache(RunPaths.resolve(recipe, cache_dir=cache_dir).cache_dir)
    settings = target_settings(recipe, cache.root)
    reference = views(report.reference) if report.reference else None
    measurer = Measurer(settings, cache, reference, providers)
    to.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="optpipe-engine-") as engine_dir:
        job = TargetJob(
            settings=settings, spec=spec.model_copy(update={"stages": [stage]}), params=params, stage=view,
            out_dir=to, root=to, cache_dir=cache.root, providers=measurer.evaluator.providers,
            stage_folder=views, measurer=measurer, extras={"engine_dir": Path(engine_dir)},
        )
        result = run_one(job)
    write_manifest(to, recipe.name, [result])
    return result


# --- the run folder ------------------------------------------------------------------------


def write_recipe_snapshot(recipe: Recipe, run_dir: Path) -> None:
    """The validated recipe beside the report, so a later export knows the dims, inputs and data."""
    document = {"base_dir": str(recipe.base_dir), "recipe": recipe.model_dump(mode="json", by_alias=True)}
    (run_dir / SNAPSHOT_FILE).write_text(json.dumps(document, indent=2))


def load_recipe_snapshot(run_dir: Path) -> Recipe:
    path = run_dir / SNAPSHOT_FILE
    if not path.is_file():
        raise TargetError(f"'{run_dir}' has no {SNAPSHOT_FILE} (written by `optpipe compile` since targets exist); rerun the compile")
    document = json.loads(path.read_text())
    return parse_recipe(document["recipe"], base_dir=Path(document["base_dir"]), origin=str(path))


def _stage_views(run_dir: Path, report) -> Callable[[str], Optional[StageView]]:
    """Look up a finished stage of the run by name: its folder and its report row."""
    def view(name: str) -> Optional[StageView]:
        result = report.stage(name)
        folder = run_dir / "stages" / name
        if result is None or result.status != "ok" or not any((folder / f).is_file() for f in ("model.onnx", "model.xml")):
            return None
        return StageView(name, folder, result)

    return view


def _format_refusal(job: TargetJob) -> str | None:
    """An OpenVINO IR stage has no ONNX: only the openvino target (and Triton's openvino backend) take it."""
    if not (job.stage.folder / "model.xml").is_file() or job.spec.kind == "openvino":
        return None
    if job.spec.kind == "triton" and getattr(job.params, "platform", None) == "openvino":
        return None
    return (f"stage '{job.stage.name}' is an OpenVINO IR (no ONNX); export it with the openvino target "
            "or Triton's openvino platform")


def _why_missing(report, stage: str) -> str:
    result = report.stage(stage)
    if result is None:
        names = ", ".join(s.name for s in report.stages if s.pass_name != "eager")
        return f"stage '{stage}' is not in this run; stages: {names}"
    if result.status != "ok":
        return f"stage '{stage}' {result.status}: {result.reason}"
    return f"stage '{stage}' has no model in the run folder (the PyTorch baseline has none)"


def _out_dir(targets_dir: Path, kind: str, stage: str) -> Path:
    # A Triton repository holds every stage's model; the other targets get a folder per stage.
    return targets_dir / kind if kind == "triton" else targets_dir / kind / stage
