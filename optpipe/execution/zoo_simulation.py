"""How compile time for a zoo of recipes grows with workers: a simulation over measured stage timings.

Input: report.json files (each stage's pass time `duration_s`, and its evaluation time
`evaluation_s` where the run recorded it). The zoo is those recipes repeated to `--recipes`.
The schedule is the Ray executor's: a pass needs one CPU and its parent finished; an
evaluation needs its stage and the reference finished and holds a whole node (the `benchmark`
slot: nothing else runs there meanwhile). Greedy list scheduling, longest work first, as a
stand-in for Ray's scheduler: an estimate of the shape of the curve, not a promise.

    python -m optpipe.execution.zoo_simulation runs/minilm/report.json --recipes 50 --workers 1 2 4 8 16
"""
from __future__ import annotations

import argparse
import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

from optpipe.core.results import EAGER


@dataclass(order=True)
class _Task:
    priority: float
    name: str = field(compare=False)
    seconds: float = field(compare=False)
    whole_node: bool = field(compare=False)
    needs: tuple[str, ...] = field(compare=False)


def tasks_of(report: dict, prefix: str) -> list[_Task]:
    """One pass task and one evaluation task per finished stage of a report."""
    stages = [s for s in report["stages"] if s["status"] == "ok" and s["name"] != EAGER]
    reference = report.get("reference")
    tasks = []
    for s in stages:
        parent = f"{prefix}/{s['parent']}/pass" if s.get("parent") else None
        tasks.append(_Task(0, f"{prefix}/{s['name']}/pass", float(s.get("duration_s") or 0.0), False, (parent,) if parent else ()))
        needs = [f"{prefix}/{s['name']}/pass"] + ([f"{prefix}/{reference}/pass"] if reference and reference != s["name"] else [])
        tasks.append(_Task(0, f"{prefix}/{s['name']}/eval", evaluation_seconds(s, report), True, tuple(needs)))
    return tasks


def evaluation_seconds(stage: dict, report: dict) -> float:
    """The recorded evaluation time, else the timed iterations' share of it (p50 x iterations + warm-up)."""
    if stage.get("evaluation_s") is not None:
        return float(stage["evaluation_s"])
    settings = report.get("evaluation", {})
    runs = settings.get("iterations", 30) + settings.get("warmup", 5)
    return sum(lat["p50_ms"] * runs for lat in stage.get("latency", [])) / 1000.0


def simulate(tasks: list[_Task], nodes: int, cpus_per_node: int) -> float:
    """Makespan in seconds of `tasks` on `nodes` nodes of `cpus_per_node` CPUs each."""
    remaining = {t.name: t for t in tasks}
    finished: dict[str, float] = {}
    free = [cpus_per_node] * nodes
    running: list[tuple[float, int, str, int]] = []  # (end, node, task, cpus)
    now = 0.0
    # Longest chains first: a stage's priority is its time plus the longest path after it.
    tail = _tails(tasks)
    while remaining or running:
        ready = sorted((t for t in remaining.values() if all(n in finished for n in t.needs)),
                       key=lambda t: -tail[t.name])
        for task in ready:
            want = cpus_per_node if task.whole_node else 1
            node = next((i for i in range(nodes) if free[i] >= want), None)
            if node is None:
                continue
            free[node] -= want
            start = max([now] + [finished[n] for n in task.needs])
            heapq.heappush(running, (start + task.seconds, node, task.name, want))
            del remaining[task.name]
        if not running:
            raise ValueError("tasks wait on something that never finishes")
        end, node, name, cpus = heapq.heappop(running)
        now = end
        finished[name] = end
        free[node] += cpus
    return now


def _tails(tasks: list[_Task]) -> dict[str, float]:
    after: dict[str, list[_Task]] = {}
    for t in tasks:
        for n in t.needs:
            after.setdefault(n, []).append(t)
    memo: dict[str, float] = {}

    def tail(t: _Task) -> float:
        if t.name not in memo:
            memo[t.name] = t.seconds + max((tail(c) for c in after.get(t.name, [])), default=0.0)
        return memo[t.name]

    return {t.name: tail(t) for t in tasks}


def zoo(reports: list[dict], recipes: int) -> list[_Task]:
    return [task for i in range(recipes) for task in tasks_of(reports[i % len(reports)], f"r{i}")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--recipes", type=int, default=50)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--cpus-per-node", type=int, default=2)
    args = parser.parse_args(argv)
    reports = [json.loads(p.read_text()) for p in args.reports]
    tasks = zoo(reports, args.recipes)
    serial = sum(t.seconds for t in tasks)
    print(f"{args.recipes} recipes, {len(tasks)} tasks, {serial / 3600:.2f} h of work one after the other")
    print("| nodes | makespan h | speed-up | efficiency |")
    print("|---|---|---|---|")
    base = None
    for nodes in args.workers:
        span = simulate(tasks, nodes, args.cpus_per_node)
        base = base or span * args.workers[0]
        print(f"| {nodes} | {span / 3600:.2f} | {base / span:.1f}x | {base / span / nodes:.0%} |")


if __name__ == "__main__":
    main()
