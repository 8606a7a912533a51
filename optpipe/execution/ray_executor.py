"""The Ray executor: each stage's pass and each evaluation is a Ray task (Ray's public API only).

- Passes run where CPUs (and the stage's declared resources) are free; a stage's parent
  reaches it as an ObjectRef, so Ray orders them and a stage never waits for a GPU node
  unless it asks for a GPU.
- An evaluation holds the node's `benchmark` resource (capacity 1 per node, declared by
  `ray start --resources='{"benchmark": 1}'`) and every CPU of the smallest benchmark node:
  no two candidates are ever timed at once on one machine, and no compile runs beside a timing.
- Every task writes through the shared cache (key lock, atomic rename), so a task Ray retries
  after its worker died finds either nothing or a whole entry: the run ends as a clean one would.
"""
from __future__ import annotations

import logging
import re
import socket
import time
from typing import Any

from optpipe.core.errors import OptpipeError, first_line
from optpipe.execution.signals import signal_handlers_kept
from optpipe.execution.executors import Plan, Progress, outcome_label, result_detail, result_label
from optpipe.execution.ray_targets import RayTargets, ray_options as _ray_resources, ray_start_flags
from optpipe.execution.stage_tasks import evaluate, node_description, run_stage
from optpipe.recipe.schema import GPU_PROVIDERS, EvaluateSpec
from optpipe.core.runtime import requested_providers

BENCHMARK = "benchmark"
# A task whose worker or node dies is retried on another node (Ray's own retry); an error the
# pass raised is a result, never retried.
MAX_RETRIES = 3


def _pass_task(compile_plan, name, parent, settings):
    started = time.perf_counter()
    parent_outcome = parent[0] if parent is not None else None
    outcome = run_stage(compile_plan, name, parent_outcome, settings)
    return outcome, node_description(), time.perf_counter() - started


def _eval_task(compile_plan, name, stage, parent_name, parent, reference_name, reference, eager, settings):
    started = time.perf_counter()
    outcomes = {}
    if reference is not None:
        outcomes[reference_name] = reference[0]
    if parent is not None:  # to tell a stage that changed nothing
        outcomes[parent_name] = parent[0]
    if name is not None:
        outcomes[name] = stage[0]
    results = evaluate(compile_plan, [name] if name else [], outcomes, reference_name, eager, settings)
    return results[0], node_description(), time.perf_counter() - started


class RayExecutor:
    runs_here = False  # the stages run on the cluster's nodes, with their own memory

    def __init__(self, address: str | None):
        try:
            import ray
        except ImportError:
            raise OptpipeError("--executor ray: Ray is not installed; pip install 'optpipe[ray]' (or use the local executor)") from None
        self.ray = ray
        if address not in (None, "auto"):
            _check_reachable(address)
        # Ray's own INFO/WARNING lines (timestamped: "Started a local Ray instance", the token-auth notice)
        # stay off the console, whose lines are optpipe's; its refusals still arrive as exceptions, below.
        quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
        try:
            # Ray installs its own SIGTERM handlers in the driver: optpipe's (exit 143, one line) are kept.
            with signal_handlers_kept():
                if address is None:
                    # No cluster named: a Ray instance on this machine, one benchmark slot.
                    # address="local": a new instance even where another Ray cluster left its address in /tmp/ray.
                    ray.init(address="local", resources={BENCHMARK: 1}, include_dashboard=False, **quiet)
                else:
                    ray.init(address=address, **quiet)
        except ConnectionError as exc:
            raise OptpipeError(f"--address {address}: no Ray cluster answers there ({first_line(exc)}); start one with `ray start --head` or fix the address") from None
        except Exception as exc:  # ray.init's other refusals (bad address syntax, version mismatch)
            raise OptpipeError(f"--address {address}: cannot join the Ray cluster ({type(exc).__name__}: {first_line(exc)})") from None
        self.benchmark_nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(BENCHMARK)]
        if not self.benchmark_nodes:
            self.close()
            raise OptpipeError(
                f"--executor ray: no node of the cluster declares the `{BENCHMARK}` resource, so latency could not be timed "
                "alone on a node; start each node with --resources='{\"benchmark\": 1}'"
            )
        self.timing_cpus = min(n["Resources"].get("CPU", 1) for n in self.benchmark_nodes)
        self.slots = max(2, 2 * len(self.benchmark_nodes))  # timing on one node while others compile
        self._pass = ray.remote(_pass_task)
        self._eval = ray.remote(_eval_task)

    def run(self, plans: list[Plan], progress: Progress) -> None:
        ray = self.ray
        waiting: dict[Any, tuple[Plan, str, str]] = {}  # ref -> (plan, stage, pass | evaluate)
        for plan in plans:
            self._check_resources(plan)
            compile_plan = ray.put(plan.compile_plan)
            refs: dict[str, Any] = {}
            for name in plan.stages:
                parent = plan.compile_plan.stages[name].parent
                parent_ref = refs.get(parent) or (_done(plan.memo.outcomes[parent]) if parent else None)
                refs[name] = self._pass.options(name=f"pass {name}", max_retries=MAX_RETRIES, **_ray_resources(plan.compile_plan.stages[name].resources)).remote(
                    compile_plan, name, parent_ref, plan.settings)
                waiting[refs[name]] = (plan, name, "pass")
            ref = plan.reference
            ref_arg = refs.get(ref) or (_done(plan.memo.outcomes[ref]) if ref in plan.memo.outcomes else None)
            timing = self._timing_options(plan)
            if plan.eager:
                eager = self._eval.options(name="evaluate pytorch-eager", **timing).remote(
                    compile_plan, None, None, None, None, ref, ref_arg, True, plan.settings)
                waiting[eager] = (plan, "", "eager")
            for name in plan.stages:
                parent = plan.compile_plan.stages[name].parent
                parent_arg = refs.get(parent) or (_done(plan.memo.outcomes[parent]) if parent in plan.memo.outcomes else None)
                evaluation = self._eval.options(name=f"evaluate {name}", **timing).remote(
                    compile_plan, name, refs[name], parent, parent_arg, ref, ref_arg, False, plan.settings)
                waiting[evaluation] = (plan, name, "evaluate")
        self._collect(waiting, progress)

    def _collect(self, waiting: dict, progress: Progress) -> None:
        """Take results as they finish: one progress line each, with the node that ran it."""
        from optpipe.core.results import EAGER, StageResult

        ray = self.ray
        pending = list(waiting)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            plan, name, kind = waiting[done[0]]
            try:
                value, node, seconds = ray.get(done[0])
            except Exception as exc:  # retries spent (or a task that could not run): the stage fails, the run goes on
                reason = f"Ray task failed after {MAX_RETRIES} retries: {type(exc).__name__}: {first_line(exc)}"
                spec = plan.compile_plan.stages.get(name)
                value = StageResult(name=name or EAGER, pass_name=spec.pass_name if spec else "eager",
                                    parent=spec.parent if spec else None, status="failed", reason=reason)
                node, seconds = None, 0.0
            if kind == "pass":
                plan.memo.outcomes[name] = value
                progress.stage(plan, name, "pass", outcome_label(value), seconds, node, value.reason or "")
            elif kind == "eager":
                plan.memo.eager = value
                progress.stage(plan, value.name, "evaluate", result_label(value), seconds, node, result_detail(value))
            else:
                value.evaluation_s = round(seconds, 3)
                plan.memo.results[name] = value
                progress.stage(plan, name, "evaluate", result_label(value), seconds, node, result_detail(value))

    def _timing_options(self, plan: Plan) -> dict:
        declared = evaluation_resources(plan.compile_plan.evaluate, plan.settings.providers)
        declared.setdefault("CPU", max(self.timing_cpus, plan.compile_plan.evaluate.threads))
        options = _ray_resources(declared)
        options.setdefault("resources", {})[BENCHMARK] = 1
        return {"max_retries": MAX_RETRIES, **options}

    def target_runner(self, compile_plan, settings, report, progress: Progress) -> RayTargets:
        """Each target a Ray task with the resources its build needs (see optpipe.execution.ray_targets)."""
        # A target times its artifact: the node's benchmark slot and its CPUs, as an evaluation (not
        # evaluate.resources: a CPU target must not wait for a GPU type an evaluation asks for), and a
        # GPU where the stages were timed on one (target_resources says which kinds).
        timing = {"CPU": max(self.timing_cpus, compile_plan.evaluate.threads), BENCHMARK: 1}
        on_gpu = requested_providers(compile_plan.evaluate.providers, settings.providers) in GPU_PROVIDERS
        return RayTargets(self.ray, timing, compile_plan, settings, report, progress, MAX_RETRIES, evaluation_on_gpu=on_gpu)

    def _check_resources(self, plan: Plan) -> None:
        """A stage asking for what no node has would wait forever: say so before submitting."""
        total = self.ray.cluster_resources()
        evaluate = plan.compile_plan.evaluate
        providers = requested_providers(evaluate.providers, plan.settings.providers)
        wanted = [("evaluate.resources", evaluation_resources(evaluate, plan.settings.providers))]
        wanted += [(f"stages.{n}.resources", plan.compile_plan.stages[n].resources) for n in plan.stages]
        for where, resources in wanted:
            for key, amount in resources.items():
                if total.get(key, 0) < amount:
                    flag = ray_start_flags({key: amount})
                    fix = "drop the request"
                    if where == "evaluate.resources" and key not in evaluate.resources:  # the GPU providers: cuda implies
                        where, fix = f"evaluate.providers: {providers} (a GPU per evaluation)", "set evaluate.providers: cpu"
                    raise OptpipeError(f"{where}: {key}={amount:g} but the Ray cluster has {total.get(key, 0):g}; "
                                       f"start a node with it (ray start {flag}) or {fix}")

    def close(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()


def evaluation_resources(evaluate: EvaluateSpec, run_providers: str = "auto") -> dict[str, float]:
    """What an evaluation task asks Ray for besides its timing slot: `evaluate.resources`, plus a GPU
    when the evaluation runs on one (providers cuda or tensorrt). Ray hides the GPUs from a task that
    asks for none, so without it a CUDA evaluation would quietly time the CPU. Declared values win."""
    resources = dict(evaluate.resources)
    if requested_providers(evaluate.providers, run_providers) in GPU_PROVIDERS:
        resources.setdefault("GPU", 1)
    return resources


def _done(outcome) -> tuple:
    """A parent computed in an earlier round, in the shape a task's result has."""
    return (outcome, None, 0.0)


def _check_reachable(address: str) -> None:
    """A wrong address fails in a second with one line, instead of Ray's long connection retries."""
    match = re.fullmatch(r"(?:ray://)?\[?([^\]]+?)\]?:(\d+)", address)
    if not match:
        raise OptpipeError(f"--address {address}: expected auto, HOST:PORT or ray://HOST:PORT")
    host, port = match.group(1), int(match.group(2))
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise OptpipeError(f"--address {address}: nothing answers at {host}:{port} ({exc.strerror or exc}); is the Ray cluster up?") from None
