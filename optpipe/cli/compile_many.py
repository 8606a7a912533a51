"""`optpipe compile` for several recipes, searches, and the Ray executor: the command's output and exit code."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from optpipe.core.errors import OptpipeError
from optpipe.recipe.schema import Recipe
from optpipe.recipe.run_paths import RunPaths


def compile_fanned_out(recipes: list[Recipe], executor_name: str, address: str | None, output: Path | None, force: bool,
                       only: str | None, cache_dir: Path | None, yes: bool, group_by_node: bool,
                       remote_cache: str | None = None) -> int:
    from optpipe.cli.failures import STAGE_FAILED, failure_lines
    from optpipe.execution.executors import LocalExecutor
    from optpipe.search.runner import compile_recipes
    from optpipe.search.space import SearchSpace
    from optpipe.reporting.run_report import stage_table

    if only is not None and (len(recipes) > 1 or SearchSpace.declared(recipes[0])):
        raise OptpipeError("--only runs one recipe's stage and its ancestors; it does not combine with searches "
                           "or several recipes")
    if only is not None:  # an unknown stage is one line before any Ray instance starts
        from optpipe.plan.dag import build_dag, only_order

        only_order(build_dag(recipes[0].stages), only)
    if remote_cache:
        remote_cache = _check_remote(remote_cache)
    if executor_name == "ray":
        from optpipe.execution.ray_executor import RayExecutor

        executor = RayExecutor(address)
    else:
        executor = LocalExecutor()
    try:
        reports = compile_recipes(recipes, executor, cache_dir=cache_dir, output=output, force=force, yes=yes,
                                  group_by_node=group_by_node, remote_cache=remote_cache, only=only)
    finally:
        executor.close()
    codes = []
    for recipe, (report, failed) in zip(recipes, reports):
        run_dir = RunPaths.resolve(recipe, output).run_dir
        if report.search is None:
            click.echo(stage_table(report))
        click.echo(f"report {recipe.name}: {run_dir / 'report.md'}, {run_dir / 'report.html'} (data: report.json)")
        lines, recipe_code = failure_lines(failed, report.failed_targets, prefix=f"{recipe.name}: ")
        for line in lines:
            click.echo(line, err=True)
        codes.append(recipe_code)
    sys.stdout.flush()
    return STAGE_FAILED if STAGE_FAILED in codes else max(codes, default=0)  # a stage failure outranks the input's


def _check_remote(url: str) -> str:
    """A remote cache that cannot be opened is the user's to fix: one line, before any work.
    Returns the URL every process opens (a relative folder made absolute)."""
    from optpipe.cache.backends import open_remote

    return open_remote(url).check()
