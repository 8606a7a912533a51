"""Deployable artifacts from finished stages: ORT bundles, TensorRT engines, Triton repositories.

`run_targets` runs after the report is built and before it is written (from `compile_recipe`): each recipe target
writes its artifact for each of its stages (default: the Pareto frontier) under
`<run>/targets/<kind>/`, records a TargetResult (status ok / skipped / failed, reason apart) in the
report, and the run folder gets a manifest of every artifact. `export_stage` does the same
later for one stage of a finished run, without recomputing anything.
"""
from __future__ import annotations

import importlib
import logging
import shutil
import tempfile
import traceback
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pydantic import ValidationError

from optpipe.core.errors import OptpipeError, RecipeError, TargetError, first_line
from optpipe.pass_infra.instruments import Instrument
from optpipe.recipe.schema import Recipe, TargetSpec, describe_validation_error
# The run folder's recipe.json: written by the compile (the recipe's own loader writes and reads it), read here by `export_stage`.
from optpipe.safety.recipe_loading import SNAPSHOT_FILE, load_recipe_snapshot, write_recipe_snapshot  # noqa: F401  (re-exported)
from optpipe.core.results import RunReport
from optpipe.targets.base import PARAMS, StageView, TargetJob, TargetParams, TargetResult, TargetSettings
from optpipe.targets.manifest import check_export_folder, write_manifest

__all__ = ["run_targets", "build_one", "target_resources", "gpu_type_resource", "TargetWork", "TargetRunner", "target_settings", "write_recipe_snapshot", "export_stage", "validate_targets", "load_recipe_snapshot", "TargetResult", "KINDS"]

# kind -> (module, function); imported when used, so `import optpipe.targets` stays light.
BUILDERS = {
    "ort": ("optpipe.targets.ort_bundle", "write_bundle"),
    "tensorrt": ("optpipe.targets.tensorrt", "build_target"),
    "triton": ("optpipe.targets.triton", "write_repository"),
    "openvino": ("optpipe.targets.openvino", "write_ir"),
}
KINDS = tuple(BUILDERS)
log = logging.getLogger("optpipe.targets")


def validate_targets(targets: Sequence[TargetSpec]) -> None:
    """Each target's params against its kind's schema, as a RecipeError naming the YAML path."""
    for index, spec in enumerate(targets):
        target_params(spec, f"targets.{index}.params")


def target_params(spec: TargetSpec, where: str) -> TargetParams:
    schema = PARAMS[spec.kind]
    try:
        return schema.model_validate(spec.params)
    except ValidationError as exc:
        raise RecipeError(describe_validation_error(exc, schema, spec.params, prefix=where)) from None


def target_settings(recipe: Recipe, cache_root: Path) -> TargetSettings:
    """The settings of a recipe read back from a run folder's snapshot (`export_stage`, serving): a
    compile gives the targets `CompilePlan.target_settings` instead, and no Recipe."""
    return TargetSettings.build(
        recipe.name, recipe.evaluate, recipe.model_source(), recipe.data, {name: stage.after for name, stage in recipe.stages.items()},
        {name: recipe.tolerance_for(name) for name in recipe.stages}, tuple(recipe.targets), cache_root,
    )


@dataclass(frozen=True)
class TargetWork:
    """One target for one stage, as an executor schedules it: plain data, so it pickles to any node."""

    index: int  # in the recipe's `targets:` list
    spec: TargetSpec
    stage: str

    @property
    def label(self) -> str:
        return f"{self.spec.kind} {self.stage}"


# An executor's way to build a batch of targets (a Ray task each); `shared` carries results
# between batches (the engines a Triton repository reuses). None: build them here, in turn.
TargetRunner = Callable[[list[TargetWork], dict[str, Any]], list[TargetResult]]


def run_targets(
    settings: TargetSettings,
    report: RunReport,
    run_dir: Path,
    cache,
    providers: str = "auto",
    instruments: Instrument = Instrument(),
    runner: Optional[TargetRunner] = None,
) -> list[TargetResult]:
    """Write every target of the recipe for its stages; record the results in `report.targets`.
    The caller writes the recipe snapshot first (`write_recipe_snapshot`)."""
    # Written afresh each run: a model left in the Triton repository by an earlier recipe would be served.
    shutil.rmtree(run_dir / "targets", ignore_errors=True)
    if not settings.targets:
        (run_dir / "manifest.json").unlink(missing_ok=True)
        return []
    results: list[TargetResult] = []
    shared: dict[str, Any] = {}
    local: dict[str, Any] = {}  # this process's Measurer, built once for every target it builds
    # By kind, TensorRT first: a tensorrt_plan model of Triton reuses the engine built in this run.
    for kind in KINDS:
        works, skipped = _works_of_kind(settings, report, kind)
        results += skipped
        for work in works:
            instruments.before_target(work.spec.kind, work.stage)
        if runner is not None and works:
            built = runner(works, shared)
        else:
            built = [build_one(settings, report, run_dir, cache, providers, work, shared, local) for work in works]
        for work, result in zip(works, built):
            _share_engine(shared, work, result)
            instruments.target_done(result)
        results += built
    report.targets = results
    write_manifest(run_dir, settings.recipe_name, results)
    for line in gpu_warnings(results):  # here, in the driver, whichever executor built them
        log.warning(line)
    return results


def build_one(settings: TargetSettings, report: RunReport, run_dir: Path, cache, providers: str, work: TargetWork,
              shared: dict[str, Any], local: Optional[dict[str, Any]] = None) -> TargetResult:
    """One target for one stage of the run folder (here, or in an executor's task on another node)."""
    from optpipe.targets.measure import Measurer

    views = _stage_views(run_dir, report)
    view = views(work.stage)
    if view is None:
        return TargetResult(kind=work.spec.kind, stage=work.stage, status="skipped", reason=_why_missing(report, work.stage, run_dir))
    local = {} if local is None else local
    if "measurer" not in local:
        reference = views(report.reference) if report.reference else None
        local["measurer"] = Measurer(settings, cache, reference, providers)
    measurer = local["measurer"]
    job = TargetJob(
        settings=settings, spec=work.spec, params=target_params(work.spec, f"targets.{work.index}.params"), stage=view,
        out_dir=_out_dir(run_dir / "targets", work.spec.kind, work.stage), root=run_dir, cache_dir=cache.root,
        providers=measurer.evaluator.providers, stage_folder=views, measurer=measurer,
        stages_defaulted=not work.spec.stages, extras=shared,
    )
    return run_one(job)


def target_resources(spec: TargetSpec, evaluation_on_gpu: bool = False) -> dict[str, float]:
    """What building (and timing) the target needs from a node, in the recipe's `resources` terms.

    A TensorRT engine (also one Triton builds for its tensorrt platform, or serves with `device: gpu`)
    is built and timed on a GPU; `gpu_type: h200` also asks for the custom resource `gpu:h200`, which
    only nodes of that GPU type declare. When the stages were evaluated on a GPU (`evaluate.providers`
    cuda or tensorrt), targets timed through ONNX Runtime ask for one too, so their figures and the
    providers they record are the GPU's. Other targets ask for no GPU: they never wait for a GPU node.
    """
    needs: dict[str, float] = {"CPU": 1}
    platform = spec.params.get("platform")
    on_gpu = (spec.kind == "tensorrt" or spec.gpu_type or (spec.kind == "triton" and (platform == "tensorrt" or spec.params.get("device") == "gpu"))
              or (evaluation_on_gpu and spec.kind != "openvino" and platform != "openvino"))
    if on_gpu:
        needs["GPU"] = 1
    if spec.gpu_type:
        needs[gpu_type_resource(spec.gpu_type)] = 1
    return needs


def gpu_type_resource(gpu_type: str) -> str:
    """The Ray custom resource a node of this GPU type declares: `gpu:<type>` (lower case)."""
    return f"gpu:{gpu_type}"


def default_target_stages(report: RunReport) -> list[str]:
    """What a target without `stages` emits: the run's Pareto frontier; for a search, the search's
    candidates (its frontier within tolerance, on the objectives the user chose), not a frontier
    that also weighs what the search was told to ignore (a p50 in a search over accuracy and size)."""
    if report.search is not None:
        return list(report.search.get("frontier_within_tolerance") or [])
    return list(report.pareto)


def _works_of_kind(settings: TargetSettings, report: RunReport, kind: str) -> tuple[list[TargetWork], list[TargetResult]]:
    works, skipped = [], []
    for index, spec in enumerate(settings.targets):
        if spec.kind != kind:
            continue
        target_params(spec, f"targets.{index}.params")
        stages = spec.stages or default_target_stages(report)
        if not stages:
            skipped.append(TargetResult(kind=spec.kind, stage="", status="skipped", reason=(
                f"no stage is on the Pareto frontier (none finished within tolerance); name stages in targets.{index}.stages")))
        works += [TargetWork(index, spec, stage) for stage in stages]
    return works, skipped


def _share_engine(shared: dict[str, Any], work: TargetWork, result: TargetResult) -> None:
    """An engine built in another process reaches the Triton targets as it would in this one."""
    if work.spec.kind == "tensorrt":
        from optpipe.targets.tensorrt import engine_result_key

        params = target_params(work.spec, f"targets.{work.index}.params")
        shared.setdefault("engines", {})[engine_result_key(work.stage, params)] = result


def run_one(job: TargetJob) -> TargetResult:
    """One target for one stage; its failure is recorded, never raised, so the other targets go on."""
    module, function = BUILDERS[job.spec.kind]
    job = ir_on_triton(job)
    refusal = _format_refusal(job)
    if refusal:
        return job.result("skipped", refusal)
    build = getattr(importlib.import_module(module), function)
    try:
        return _checked_gpu_type(job, build(job))
    except OptpipeError as exc:
        return job.result("failed", str(exc))
    except Exception as exc:  # a bug or a library refusing the model must not stop the other targets
        log.debug("target %s for %s failed:\n%s", job.spec.kind, job.stage.name, traceback.format_exc())
        return job.result("failed", f"{job.spec.kind} target error ({type(exc).__name__}: {first_line(exc)})")


def _checked_gpu_type(job: TargetJob, result: TargetResult) -> TargetResult:
    """A built target that names a gpu_type records whether this machine's GPU is that type."""
    if job.spec.gpu_type and result.ok:
        from optpipe.targets.gpu_type import check_gpu_type

        engine = job.spec.kind == "tensorrt" or getattr(job.params, "platform", None) == "tensorrt"
        result.gpu_check = check_gpu_type(job.spec.gpu_type, engine)
    return result


def gpu_warnings(results: list[TargetResult]) -> list[str]:
    """One line per target built on another GPU type than its gpu_type (or on none), or that will not
    run at the precision it was measured at (details.warning)."""
    return ([f"target {r.kind} for '{r.stage}' {r.gpu_check['warning']}" for r in results if r.gpu_check and r.gpu_check["warning"]]
            + [f"target {r.kind} for '{r.stage}': {r.details['warning']}" for r in results if r.details.get("warning")])


def export_stage(
    run_dir: Path,
    stage: str,
    kind: str,
    to: Path,
    cache_dir: Optional[Path] = None,
    providers: str = "auto",
    overrides: Optional[dict[str, Any]] = None,
    force: bool = False,
) -> TargetResult:
    """Write one target for one stage of a finished run into `to` (plus a manifest there).

    Reads report.json, recipe.json and the stage's folder; recomputes no stage. The recipe's
    params for that kind of target are used where the recipe has one, with `overrides` on top
    (`optpipe serve`: Triton's python backend). `to` follows the folder rules of a run folder
    (manifest.check_export_folder); `force`: write over files optpipe did not write.
    """
    from optpipe.cache.store import StageCache
    from optpipe.recipe.run_paths import RunPaths
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
    if overrides:
        spec = spec.model_copy(update={"params": {**spec.params, **overrides}})
    params = target_params(spec, f"targets.{index}.params")
    cache_root = RunPaths.resolve(recipe, cache_dir=cache_dir).cache_dir
    check_export_folder(to, cache_root, force)  # before the cache is opened: a refused export creates nothing
    cache = StageCache(cache_root)
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
        refusal = _format_refusal(ir_on_triton(job))
        if refusal:  # the user asked for this format by name: refused (exit 2), not a skipped export that exits 0
            raise TargetError(f"--format {kind}: {refusal}")
        result = run_one(job)
    write_manifest(to, recipe.name, [result])
    for line in gpu_warnings([result]):
        log.warning(line)
    return result


# --- the run folder ------------------------------------------------------------------------


def _stage_views(run_dir: Path, report) -> Callable[[str], Optional[StageView]]:
    """Look up a finished stage of the run by name: its folder and its report row."""
    def view(name: str) -> Optional[StageView]:
        result = report.stage(name)
        folder = run_dir / "stages" / name
        if result is None or result.status != "ok" or not any((folder / f).is_file() for f in ("model.onnx", "model.xml")):
            return None
        return StageView(name, folder, result)

    return view


def ir_on_triton(job: TargetJob) -> TargetJob:
    """A Triton target whose platform the recipe left at its default serves an OpenVINO IR stage with
    the openvino backend: the only one that reads an IR (an explicit platform is kept, and refused)."""
    if job.spec.kind != "triton" or not (job.stage.folder / "model.xml").is_file() or "platform" in job.params.model_fields_set:
        return job
    return dataclasses.replace(job, params=job.params.model_copy(update={"platform": "openvino"}))


def _format_refusal(job: TargetJob) -> str | None:
    """An OpenVINO IR stage has no ONNX: only the openvino target (and Triton's openvino backend) take it."""
    if not (job.stage.folder / "model.xml").is_file() or job.spec.kind == "openvino":
        return None
    if job.spec.kind == "triton" and getattr(job.params, "platform", None) == "openvino":
        return None
    return (f"stage '{job.stage.name}' is an OpenVINO IR (no ONNX); export it with the openvino target "
            "or Triton's openvino platform")


def _why_missing(report, stage: str, run_dir: Optional[Path] = None) -> str:
    result = report.stage(stage)
    if result is None:
        names = ", ".join(s.name for s in report.stages if s.pass_name != "eager")
        return f"stage '{stage}' is not in this run; stages: {names}"
    if result.status != "ok":
        return f"stage '{stage}' {result.status}: {result.reason}"
    if run_dir is not None and not (run_dir / "stages").is_dir():
        import platform

        return (f"the run folder {run_dir} is not visible on {platform.node()}; put it on the filesystem every node "
                "shares (-o /shared/path), as the cache is")
    return f"stage '{stage}' has no model in the run folder (the PyTorch baseline has none)"


def _out_dir(targets_dir: Path, kind: str, stage: str) -> Path:
    # A Triton repository holds every stage's model; the other targets get a folder per stage.
    return targets_dir / kind if kind == "triton" else targets_dir / kind / stage
