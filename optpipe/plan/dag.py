"""The stage DAG: one node per stage, edges from each stage's `after:`."""
from __future__ import annotations

import networkx as nx

from optpipe.core.errors import OptpipeError, RecipeError
from optpipe.recipe.schema import StageSpec, suggest


def build_dag(stages: dict[str, StageSpec]) -> nx.DiGraph:
    """The DAG of a recipe's `stages`, or a RecipeError naming the unknown parent or the cycle."""
    graph = nx.DiGraph()
    for name, stage in stages.items():
        graph.add_node(name, spec=stage)
    for name, stage in stages.items():
        if stage.after is None:
            continue
        if stage.after not in stages:
            raise RecipeError(
                f"stages.{name}.after: unknown stage '{stage.after}'{suggest(stage.after, stages)}; "
                f"stages are: {', '.join(stages)}"
            )
        graph.add_edge(stage.after, name)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        names = " -> ".join([edge[0] for edge in cycle] + [cycle[0][0]])
        raise RecipeError(f"stages: the `after:` links form a cycle ({names}); one of them must start from a parent outside it")
    return graph


def execution_order(graph: nx.DiGraph) -> list[str]:
    """Topological order, ties broken by recipe order so runs read predictably."""
    position = {name: i for i, name in enumerate(graph.nodes)}
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: position[n]))


def ancestors_and_self(graph: nx.DiGraph, stage: str) -> set[str]:
    return nx.ancestors(graph, stage) | {stage}


def only_order(graph: nx.DiGraph, only: str | None) -> list[str]:
    """`--only STAGE`: that stage and its ancestors, in execution order (None: every stage)."""
    order = execution_order(graph)
    if only is None:
        return order
    if only not in graph:
        raise OptpipeError(f"--only: unknown stage '{only}'; stages are: {', '.join(order)}")
    keep = ancestors_and_self(graph, only)
    return [name for name in order if name in keep]
