"""Targets (TensorRT engines, Triton repositories, ORT bundles, OpenVINO IRs) as Ray tasks.

Each target for each stage is one task asking for what its build needs
(`optpipe.targets.target_resources`): a GPU for a TensorRT engine, plus the custom resource
`gpu:<type>` when the target names a `gpu_type`, so an engine is built and timed on the GPU
type that will serve it. Targets that need no GPU never ask for one. Like an evaluation, a
target task holds the node's `benchmark` slot: it times its artifact.

A task whose resources no live node offers would wait forever: it is failed with one line
naming the resource and the `ray start` flag that adds it, before submission and again if the
node offering it dies while the task waits; the other targets and the run go on.
"""
from __future__ import annotations

import time
from typing import Any

from optpipe.core.errors import first_line
from optpipe.execution.executors import Progress
from optpipe.execution.stage_tasks import TaskSettings, build_target
from optpipe.plan.compile_plan import CompilePlan
from optpipe.core.results import TargetResult

RECHECK_S = 5.0  # how often waiting target tasks are checked against the live nodes' resources


def _target_task(compile_plan, report, work, shared, settings):
    started = time.perf_counter()
    result = build_target(compile_plan, report, work, shared, settings)
    return result, result.built_on, time.perf_counter() - started


class RayTargets:
    """The TargetRunner of one recipe's run on a Ray executor."""

    def __init__(self, ray, timing: dict[str, float], compile_plan: CompilePlan, settings: TaskSettings, report, progress: Progress, retries: int,
                 evaluation_on_gpu: bool = False):
        self.ray = ray
        self.timing = timing  # what a timing holds on a node: its benchmark slot and CPUs
        self.evaluation_on_gpu = evaluation_on_gpu  # the stages were timed on a GPU: so are the artifacts timed through ORT
        self.compile_plan, self.settings, self.report, self.progress = compile_plan, settings, report, progress
        self.retries = retries
        self._task = ray.remote(_target_task)

    def __call__(self, works: list, shared: dict[str, Any]) -> list[TargetResult]:
        from optpipe.targets import target_resources

        ray = self.ray
        compile_plan, report = ray.put(self.compile_plan), ray.put(self.report)
        results: dict[int, TargetResult] = {}
        waiting: dict[Any, tuple[int, dict]] = {}
        started = time.perf_counter()
        for i, work in enumerate(works):
            needs = self._needs(target_resources(work.spec, self.evaluation_on_gpu))
            refusal = self._refusal(needs)
            if refusal:
                results[i] = self._failed(work, refusal, 0.0)
                continue
            ref = self._task.options(name=f"target {work.label}", max_retries=self.retries, **ray_options(needs)).remote(
                compile_plan, report, work, shared, self.settings)
            waiting[ref] = (i, needs)
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1, timeout=RECHECK_S)
            if not done:
                self._fail_infeasible(works, waiting, results, started)
                continue
            i, _ = waiting.pop(done[0])
            try:
                result, node, seconds = ray.get(done[0])
            except Exception as exc:  # retries spent, or cancelled: the target fails, the others go on
                reason = f"Ray task failed after {self.retries} retries: {type(exc).__name__}: {first_line(exc)}"
                result = TargetResult(kind=works[i].spec.kind, stage=works[i].stage, status="failed", reason=reason)
                node, seconds = None, 0.0
            results[i] = result
            self.progress.target(self.compile_plan.name, result, seconds, node)
        return [results[i] for i in range(len(works))]

    def _needs(self, declared: dict[str, float]) -> dict[str, float]:
        """The target's own needs with the timing slot every target holds."""
        needs = dict(declared)
        for key, amount in self.timing.items():
            needs[key] = max(needs.get(key, 0), amount)
        return needs

    def _refusal(self, needs: dict[str, float]) -> str | None:
        """One line when no live node of the cluster offers what the task needs (else None)."""
        nodes = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
        if any(all(node.get(k, 0) >= v for k, v in needs.items()) for node in nodes):
            return None
        total = self.ray.cluster_resources()
        missing = [k for k, v in needs.items() if total.get(k, 0) < v] or list(needs)
        # The flags for a node that runs this task: every resource it needs (CPUs only when they are
        # what is missing), the missing ones first.
        flags = ray_start_flags({k: v for k, v in needs.items() if k != "CPU" or k in missing}, first=missing)
        wanted = ", ".join(f"{k}={v:g}" for k, v in needs.items())
        return (f"no node of the Ray cluster offers {' and '.join(f'`{k}`' for k in missing)} (the task needs {wanted} on one node); "
                f"start one with `ray start {flags}`")

    def _fail_infeasible(self, works: list, waiting: dict, results: dict, started: float) -> None:
        """A node that offered a task's resources may die while the task waits: fail it instead of waiting forever."""
        for ref, (i, needs) in list(waiting.items()):
            refusal = self._refusal(needs)
            if refusal:
                self.ray.cancel(ref, force=True)
                del waiting[ref]
                results[i] = self._failed(works[i], refusal, time.perf_counter() - started)

    def _failed(self, work, reason: str, seconds: float) -> TargetResult:
        result = TargetResult(kind=work.spec.kind, stage=work.stage, status="failed", reason=reason)
        self.progress.target(self.compile_plan.name, result, seconds, None)
        return result


def ray_start_flags(needs: dict[str, float], first: list[str] = ()) -> str:
    """The `ray start` flags of a node offering `needs`: --num-gpus, --resources (the names in
    `first` first), --num-cpus."""
    flags = [f"--num-gpus={needs['GPU']:g}"] if needs.get("GPU") else []
    custom = [k for k in sorted(needs, key=lambda k: k not in first) if k not in ("CPU", "GPU")]
    if custom:
        flags.append("--resources='{" + ", ".join(f'"{k}": {needs[k]:g}' for k in custom) + "}'")
    if needs.get("CPU"):
        flags.append(f"--num-cpus={needs['CPU']:g}")
    return " ".join(flags)


def ray_options(needs: dict[str, float]) -> dict:
    """A recipe's `resources` (CPU, GPU, custom names such as a GPU type) as Ray task options."""
    options: dict[str, Any] = {"num_cpus": needs.get("CPU", 1)}
    if needs.get("GPU"):
        options["num_gpus"] = needs["GPU"]
    custom = {k: v for k, v in needs.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options

