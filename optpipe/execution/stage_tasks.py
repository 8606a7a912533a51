"""One stage, one evaluation: the units an executor schedules (in this process or as Ray tasks).

Each function rebuilds what it needs from the compile's plan (`CompilePlan`: the recipe's typed parts,
resolved once by the driver) and the cache folder, so it can run in
any process that sees the cache; it returns plain data (StageResults). The
pass itself, the cache protocol (key lock, atomic publish) and the evaluation are the
pipeline's own: nothing here re-implements them.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optpipe.cache.backends import open_cache
from optpipe.core.artifact import MANIFEST_FILE
from optpipe.core.library_files import keep_library_files_in
from optpipe.core.results import EAGER, StageResult
from optpipe.core.runtime import cuda_device_names  # the one reader of GPU names, as targets/gpu_type.py uses
from optpipe.recipe.run_paths import mark_run_folder
from optpipe.plan.compile_plan import CompilePlan


@dataclass(frozen=True)
class TaskSettings:
    """What a task needs besides the compile plan; plain values, so it pickles to any node."""

    cache_dir: Path
    run_dir: Path
    force: bool = False
    providers: str = "auto"
    remote_cache: str | None = None  # a shared store behind the cache folder (file:// or a path, s3://, gs://)
    storage_options: dict[str, Any] = field(default_factory=dict)

    def open_cache(self):
        cache = open_cache(self.cache_dir, self.remote_cache, **self.storage_options)
        keep_library_files_in(cache.root)  # in every process a task runs in (a Ray worker too), as compile does
        return cache


def run_stage(plan: CompilePlan, name: str, parent: StageResult | None, settings: TaskSettings) -> StageResult:
    """The stage's result, its model a cache hit or its pass run and published; `parent` is its parent's result."""
    spec = plan.stages[name]
    if parent is not None and parent.status != "ok":
        return StageResult(name=name, pass_name=spec.pass_name, parent=spec.parent, status="skipped",
                           reason=f"parent stage '{spec.parent}' {parent.status}", duration_s=0.0, not_run=parent.not_run)
    cache = settings.open_cache()
    try:
        if parent is not None:
            parent = held(plan, parent, settings, cache)
            if parent.status != "ok":
                return StageResult(name=name, pass_name=spec.pass_name, parent=spec.parent, status="skipped",
                                   reason=f"parent stage '{spec.parent}' {parent.status}", duration_s=0.0)
        return _run_one(plan, name, parent, settings, cache)
    finally:
        cache.release_leases()


def _run_one(plan: CompilePlan, name: str, parent: StageResult | None, settings: TaskSettings, cache) -> StageResult:
    from optpipe.execution.services import RunServices
    from optpipe.execution.stage_runner import StageRunner
    from optpipe.pass_infra.instruments import Instruments
    from optpipe.plan.source_preflight import node_refusals

    pass_ = plan.configured_pass(name)  # the driver validated the recipe: a task configures only its own pass
    mark_run_folder(settings.run_dir)  # a search or fan-out cut short leaves a folder the next run knows as a run's
    (settings.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # The memory of the machine the stage runs on (a Ray node's, not the driver's), for this plan's own params (a
    # search trial's): a stage that will not fit fails before its pass runs, after a cache miss, as in `compile`.
    runner = StageRunner(plan, cache, RunServices(plan.model_source(), plan.data, cache), settings.run_dir / "logs",
                         Instruments(), force=settings.force, too_big=lambda: node_refusals(plan))
    return runner.run(name, pass_, parent.model if parent else None)


def held(plan: CompilePlan, result: StageResult, settings: TaskSettings, cache) -> StageResult:
    """`result` with its cache entry leased by this task, so `cache gc` leaves it until the task ends.

    The entry was computed by an earlier task (another process, perhaps another node), which
    released its lease when it ended: a gc in between may have pruned it. Then it is rebuilt
    under the same key (its ancestors first, each a cache hit where its entry remains), rather
    than the task failing on a missing folder."""
    model = result.model
    if result.status != "ok" or model is None or model.folder.parent.parent != cache.root:
        return result  # not a cache entry (or not ok): nothing to hold
    cache.lease(model.folder.name)  # waits for a gc removing it right now
    if (model.folder / MANIFEST_FILE).exists():
        return result
    return _rebuilt(plan, result.name, settings, cache) if result.name in plan.stages else result


def _rebuilt(plan: CompilePlan, name: str, settings: TaskSettings, cache) -> StageResult:
    chain = [name]
    while (parent := plan.stages[chain[-1]].parent) is not None:
        chain.append(parent)
    result = None
    for stage in reversed(chain):
        result = _run_one(plan, stage, result, settings, cache)
        if result.status != "ok":
            break
    return result


def evaluate(plan: CompilePlan, names: list[str], outcomes: dict, reference: str | None, eager: bool,
             settings: TaskSettings) -> list[StageResult]:
    """Accuracy against `reference` and latency of each stage in `names` (and the eager baseline
    first when `eager`), each result stamped with the node that measured it."""
    from optpipe.execution.services import RunServices
    from optpipe.execution.stage_evaluation import EvaluationParts, evaluate_stages
    from optpipe.pass_infra.instruments import Instruments

    refused = _eager_refused(plan) if eager else None
    cache = settings.open_cache()
    scoped = plan.with_evaluate(reference=reference, eager_baseline=eager and refused is None)
    try:
        outcomes = {stage: held_keeping_figures(plan, result, settings, cache) for stage, result in outcomes.items()}
        results = evaluate_stages(EvaluationParts.of(scoped), names, outcomes, RunServices(scoped.model_source(), scoped.data, cache), cache, settings.providers, Instruments(),
                                  settings.force)
    finally:
        cache.release_leases()
    results = ([refused] if refused is not None else []) + results
    node = node_description()
    for result in results:
        if result.latency:
            result.measured_on = node
    return results


def _eager_refused(plan: CompilePlan) -> StageResult | None:
    """The eager baseline's row, failed before its model loads, where its evaluation will not fit this machine's memory
    (a Ray node smaller than the driver: where the stages run on the driver, the driver refused the run already)."""
    from optpipe.plan.source_preflight import node_refusals

    line = node_refusals(plan).get(EAGER)
    if line is None:
        return None
    return StageResult(name=EAGER, pass_name="eager", status="failed", error_kind="input", duration_s=0.0,
                       reason=f"PyTorch eager baseline not run here: {line}")


def held_keeping_figures(plan: CompilePlan, result: StageResult, settings: TaskSettings, cache) -> StageResult:
    """`held`, the outcome itself kept (its cached flag, its duration): only its model's folder is restored."""
    again = held(plan, result, settings, cache)
    if again is result or again.status != "ok":
        return result
    return result.with_model(again.model)


def build_target(plan: CompilePlan, report, work, shared: dict, settings: TaskSettings):
    """One target (optpipe.targets.TargetWork) for one stage of the run folder, stamped with the node that built it."""
    from optpipe.targets import build_one

    cache = settings.open_cache()
    try:
        result = build_one(plan.target_settings(cache.root), report, settings.run_dir, cache, settings.providers, work, shared)
    finally:
        cache.release_leases()
    result.built_on = node_description()
    return result


def node_description() -> dict:
    """Where a figure was measured: the host, its CPU model and count, its GPUs, and the Ray node."""
    from optpipe.reporting.run_report import machine_description

    machine = machine_description()
    node = {"host": platform.node(), "cpu": machine["processor"], "cores": os.cpu_count(), "gpu": cuda_device_names()}
    try:
        import ray

        if ray.is_initialized():
            node["ray_node"] = ray.get_runtime_context().get_node_id()[:12]
    except ImportError:
        pass
    return node


def hardware_class(node: dict) -> str:
    """Figures are comparable when measured on the same kind of machine: CPU model, cores, GPUs."""
    gpu = ",".join(node.get("gpu") or []) or "no GPU"
    return f"{node.get('cpu')} x{node.get('cores')} / {gpu}"
