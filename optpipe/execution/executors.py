"""Executors run plans: stages to compute and evaluate for one or more recipes.

The local executor (the default) runs them in this process, one after the other; the Ray
executor (optpipe.execution.ray_executor) runs each as a Ray task. Both call the same two
functions (optpipe.execution.stage_tasks), so a report does not depend on the executor.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from optpipe.execution.stage_tasks import TaskSettings, evaluate, node_description, run_stage
from optpipe.core.results import StageResult
from optpipe.plan.compile_plan import CompilePlan


@dataclass
class RunMemo:
    """What one recipe's run has computed so far, by stage name (the driver's side)."""

    outcomes: dict[str, StageResult] = field(default_factory=dict)  # name -> the stage's result before evaluation
    results: dict[str, StageResult] = field(default_factory=dict)
    eager: StageResult | None = None


@dataclass
class Plan:
    """Stages of one recipe to compute then evaluate; their parents are computed already or listed first."""

    label: str  # the recipe's name in progress lines
    compile_plan: CompilePlan  # the recipe's typed parts, resolved once by the driver; what its tasks take
    stages: list[str]
    reference: str | None
    eager: bool
    settings: TaskSettings
    memo: RunMemo


class Progress:
    """One line per finished stage (with the node that ran it) and per finished trial, then a summary."""

    def __init__(self, stream: TextIO | None = None, show_recipe: bool = False):
        self.stream = stream or sys.stderr
        self.show_recipe = show_recipe
        self.started = time.perf_counter()

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def stage(self, plan: Plan, name: str, what: str, status: str, seconds: float, node: dict | None, detail: str = "") -> None:
        where = f" on {_node_text(node)}" if node else ""
        prefix = f"{plan.label}: " if self.show_recipe else ""
        tail = f" — {detail}" if detail else ""
        self.line(f"  {status:>7} {prefix}{what} {name} ({seconds:.1f}s){where}{tail}")

    def target(self, label: str, result, seconds: float, node: dict | None) -> None:
        where = f" on {_node_text(node)}" if node else ""
        prefix = f"{label}: " if self.show_recipe else ""
        tail = f" — {result.reason}" if result.reason else ""
        self.line(f"  {result.status:>7} {prefix}target {result.kind} {result.stage} ({seconds:.1f}s){where}{tail}")


class Executor(Protocol):
    slots: int  # trials worth running at once
    runs_here: bool  # the stages run on this machine (its memory is theirs)

    def run(self, plans: list[Plan], progress: Progress) -> None: ...

    def target_runner(self, compile_plan: CompilePlan, settings: TaskSettings, report, progress: Progress):
        """How this executor builds a recipe's targets (optpipe.targets.TargetRunner); None: in the driver."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """This process, one stage at a time: nothing else runs while a stage is timed."""

    slots = 1
    runs_here = True

    def run(self, plans: list[Plan], progress: Progress) -> None:
        node = node_description()
        for plan in plans:
            for name in plan.stages:
                parent = plan.compile_plan.stages[name].parent
                outcome = run_stage(plan.compile_plan, name, plan.memo.outcomes.get(parent) if parent else None, plan.settings)
                plan.memo.outcomes[name] = outcome
                progress.stage(plan, name, "pass", outcome_label(outcome), outcome.duration_s, node, outcome.reason or "")
            reference = plan.memo.outcomes.get(plan.reference) if plan.reference else None
            if plan.eager:
                started = time.perf_counter()
                plan.memo.eager = evaluate(plan.compile_plan, [], _with_reference(plan, reference), plan.reference, True, plan.settings)[0]
                progress.stage(plan, plan.memo.eager.name, "evaluate", result_label(plan.memo.eager),
                               time.perf_counter() - started, node, result_detail(plan.memo.eager))
            for name in plan.stages:
                started = time.perf_counter()
                parent = plan.compile_plan.stages[name].parent
                outcomes = {**_with_reference(plan, reference), name: plan.memo.outcomes[name]}
                if parent in plan.memo.outcomes:  # to tell a stage that changed nothing
                    outcomes[parent] = plan.memo.outcomes[parent]
                result = evaluate(plan.compile_plan, [name], outcomes, plan.reference, False, plan.settings)[0]
                result.evaluation_s = round(time.perf_counter() - started, 3)
                plan.memo.results[name] = result
                progress.stage(plan, name, "evaluate", result_label(result), time.perf_counter() - started, node, result_detail(result))

    def target_runner(self, compile_plan: CompilePlan, settings: TaskSettings, report, progress: Progress):
        return None  # the targets are built here, after the run, as a plain compile builds them

    def close(self) -> None:
        pass


def _with_reference(plan: Plan, reference) -> dict:
    return {plan.reference: reference} if plan.reference and reference is not None else {}


def outcome_label(outcome) -> str:
    return "cached" if outcome.status == "ok" and outcome.cached else outcome.status


def result_label(result: StageResult) -> str:
    if result.status != "ok":
        return result.status
    return "cached" if result.evaluation_cached else "ok"  # an evaluation line: its figures, not the pass


def result_detail(result: StageResult) -> str:
    if result.status != "ok":
        return result.reason or ""
    parts = []
    if result.latency:
        parts.append(f"p50 {result.latency[0].p50_ms:.2f} ms")
    if result.accuracy:
        parts.append(result.accuracy.figure() + ("" if result.accuracy.within_tolerance else " OUT OF TOLERANCE"))
    return ", ".join(parts)


def _node_text(node: dict) -> str:
    ray_node = f" [{node['ray_node']}]" if node.get("ray_node") else ""
    return f"{node.get('host')}{ray_node}"


def settings_for(cache_dir: Path, run_dir: Path, force: bool, providers: str,
                 remote_cache: str | None = None, storage_options: dict | None = None) -> TaskSettings:
    return TaskSettings(cache_dir=cache_dir.resolve(), run_dir=run_dir.resolve(), force=force, providers=providers,
                        remote_cache=remote_cache, storage_options=storage_options or {})
