"""The pass manager: run the stage DAG with the cache, evaluate every stage, write the report.

Phases, each with one job and its own module:
1. passes (here, the loop): topological order; each stage goes to the cached stage
   runner (optpipe/execution/stage_runner.py); a failing stage marks its descendants
   skipped and the other branches go on;
2. evaluation (optpipe/execution/stage_evaluation.py): every finished stage against
   the reference stage, plus PyTorch eager;
3. report: report.json (the data) and report.md (a view of it) in the run folder,
   then the deployment targets.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
from filelock import FileLock

from optpipe.cache.store import StageCache
from optpipe.plan.dag import only_order
from optpipe.execution.interrupt import KeptTracker, explain_interruption
from optpipe.execution.run_folder import publish_stage_folders
from optpipe.execution.services import LogWriter, RunServices, stage_logger
from optpipe.source.model_source import onnx_path
from optpipe.execution.stage_evaluation import EvaluationParts, evaluate_stages
from optpipe.execution.stage_runner import StageRunner
from optpipe.pass_infra.instruments import Instrument, Instruments
from optpipe.pass_infra.pass_base import Pass
from optpipe.plan.compile_plan import CompilePlan
from optpipe.recipe.schema import Recipe
from optpipe.recipe.run_paths import RunPaths, mark_run_folder
from optpipe.core.process_memory import release_freed_memory
from optpipe.core.results import StageResult
from optpipe.reporting.inspection import save_sample_inputs
from optpipe.reporting.run_report import RunReport, build_report, write_report
from optpipe.safety.os_errors import folder_errors
from optpipe.safety.recipe_loading import write_recipe_snapshot
from optpipe.targets import run_targets
from optpipe.plan.validate import validate_recipe
from optpipe.core.library_files import keep_library_files_in


@dataclass
class RunOptions:
    output: Path | None = None
    force: bool = False
    only: str | None = None
    cache_dir: Path | None = None
    providers: str = "auto"
    instruments: list[Instrument] = field(default_factory=list)


def compile_recipe(recipe: Recipe, options: RunOptions | None = None) -> RunReport:
    """Run a recipe end to end; returns the report (also written to the run folder)."""
    tracker = KeptTracker()
    options = dataclasses.replace(options or RunOptions())
    options.instruments = [*options.instruments, tracker]
    with explain_interruption(tracker):
        return _compile(recipe, options)


def _compile(recipe: Recipe, options: RunOptions) -> RunReport:
    from optpipe.plan.source_preflight import source_preflight
    from optpipe.safety.preflight import preflight

    graph, passes = validate_recipe(recipe)
    plan = CompilePlan.of(recipe)  # the typed parts every layer below takes, resolved once
    paths = RunPaths.for_run(recipe, options.output, options.cache_dir)
    run_dir, cache_root = paths.run_dir, paths.cache_dir
    with folder_errors("cache folder", cache_root):
        cache = StageCache(cache_root)
    keep_library_files_in(cache.root)
    try:  # from here on, leases this run takes (preflight takes some) are dropped however it ends
        with folder_errors("output folder", run_dir):
            mark_run_folder(run_dir)
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        services = RunServices(plan.model_source(), plan.data, cache)
        # Seconds on a loaded machine (the model loaded and run once, the data sets built): a console phase.
        with Instruments(options.instruments).phase("preflight: the model, its inputs and the data sets"):
            said = preflight(recipe, onnx_path(recipe.model_source()), services.eval_set, services.calibration_set, cache)
            too_big = source_preflight(recipe, onnx_path(recipe.model_source()))
        order = _stages_to_run(graph, options.only)

        manager = PassManager(plan, cache, services, run_dir, options, too_big)
        instruments = manager.instruments
        stages = manager.run(order, graph, passes)
        # A library's Python warnings while stages are measured (torch's "nested tensors ... prototype" from eager's fast
        # path), and what the model's own forward() prints (a print per call: 94,000 lines between the console's), go to a
        # log beside the stages', not between the console's lines.
        with stage_logger("evaluation", run_dir / "logs" / _evaluation_log(recipe.stages)) as log, \
                contextlib.redirect_stdout(LogWriter(log)):
            results = evaluate_stages(EvaluationParts.of(plan), order, stages, services, cache, options.providers, instruments,
                                      options.force)
        report = build_report(plan.name, plan.evaluate, results, data_warnings=said)
        # Two compiles writing one run folder take turns: each leaves a consistent folder and report.
        # A full disk there names the output folder (the copies' sources are in the cache).
        with folder_errors("output folder", run_dir), FileLock(str(run_dir / ".optpipe.lock")):
            publish_stage_folders(run_dir, results)
            if any(r.status == "ok" for r in results):  # then the evaluation set was built fine
                save_sample_inputs(run_dir, services.eval_set().arrays)  # real inputs for `optpipe diff --layers`
            try:
                write_recipe_snapshot(recipe, run_dir)  # beside the report: `optpipe export` reads it
                run_targets(plan.target_settings(cache.root), report, run_dir, cache, options.providers, instruments)
            finally:
                with instruments.phase("report: report.json, report.md, report.html"):
                    write_report(report, run_dir)  # once, with the targets' rows
    finally:
        cache.release_leases()  # `cache gc` may prune what this run used from now on
        Instruments(options.instruments).run_end()
    return report


def _evaluation_log(stages) -> str:
    """The evaluation's log file, apart from every stage's (logs/<stage>.log)."""
    return "evaluation.log" if "evaluation" not in stages else "evaluation.measured.log"


def _stages_to_run(graph: nx.DiGraph, only: str | None) -> list[str]:
    return only_order(graph, only)  # shared with the fan-out executors


class PassManager:
    """The loop over stages in order: a stage whose parent did not finish is skipped, the
    others go to the cached stage runner."""

    def __init__(self, plan: CompilePlan, cache: StageCache, services: RunServices, run_dir: Path, options: RunOptions,
                 too_big: dict[str, str] | None = None):
        self.plan = plan
        self.instruments = Instruments(options.instruments)
        self.runner = StageRunner(plan, cache, services, run_dir / "logs", self.instruments, force=options.force,
                                  too_big=too_big)
        self.services = services

    def run(self, order: list[str], graph: nx.DiGraph, passes: dict[str, Pass]) -> dict[str, StageResult]:
        """Every stage's result, in order; a finished one carries its model (`result.model`)."""
        results: dict[str, StageResult] = {}
        self.instruments.run_start(order)
        for index, name in enumerate(order):
            spec = self.plan.stages[name]
            parent = results.get(spec.parent) if spec.parent else None
            if parent is not None and parent.status != "ok":
                result = StageResult(name=name, pass_name=spec.pass_name, parent=spec.parent, status="skipped",
                                     reason=f"parent stage '{parent.name}' {parent.status}", duration_s=0.0, not_run=parent.not_run)
            else:
                result = self.runner.run(name, passes[name], parent.model if parent else None)
                if not any(self._reads_torch(later) for later in order[index + 1:]):
                    self.services.release_torch_model()
                # What the pass freed goes back to the system before the next stage peaks on top of it
                # (BERT-base: 2.0 GB kept after simplify without this, 0.56 GB with; core/process_memory.py).
                release_freed_memory()
            results[name] = result
            self.instruments.stage_done(result)
        return results

    def _reads_torch(self, name: str) -> bool:
        """The export pass and a source stage's self-check against eager are what read ctx.torch_model."""
        spec = self.plan.stages[name]
        return spec.pass_name == "export" or spec.parent is None
