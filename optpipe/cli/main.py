"""The command line: a thin layer over the Python API (optpipe.compile_recipe and friends).

Exit codes: 0 success, 1 a stage failed, 2 a user error (recipe, paths, arguments, or a model that
does not load or run on the recipe's inputs: every failed stage failed on it), 3 an internal
error (a bug: one line, the traceback with OPTPIPE_DEBUG=1), 130 interrupted (Ctrl-C), 143 terminated.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import click
from rich.console import Console

from optpipe.cli.cache_commands import cache_group
from optpipe.core.errors import OptpipeError


class OptpipeGroup(click.Group):
    """Turns user errors into one line and an exit code, for every command."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OptpipeError as exc:
            from optpipe.execution.interrupt import interrupt_in

            if interrupt_in(exc) is not None:
                raise KeyboardInterrupt() from exc
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


def main() -> None:
    from optpipe.execution.signals import interrupted_exit, one_line_warnings, terminate_as_interrupt

    terminate_as_interrupt()
    one_line_warnings()
    # A log file that cannot be written (a full disk) must not print logging's own tracebacks.
    logging.raiseExceptions = False
    try:
        # Not standalone: click then returns the code of a ctx.exit() instead of exiting itself.
        code = cli(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except click.exceptions.Abort as exc:
        interrupted_exit(exc.__cause__)
    except KeyboardInterrupt as exc:
        interrupted_exit(exc)
    except click.exceptions.ClickException as exc:
        exc.show()
        sys.exit(2 if exc.exit_code == 1 else exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:
        from optpipe.execution.interrupt import interrupt_in
        from optpipe.execution.signals import internal_error_exit
        from optpipe.safety.os_errors import describe

        if interrupt_in(exc) is not None:  # a Ctrl-C a library turned into another exception
            interrupted_exit(interrupt_in(exc))
        if isinstance(exc, OptpipeError):
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        if isinstance(exc, OSError) and describe(exc):  # the environment's fault: a full disk, a file for a folder
            if os.environ.get("OPTPIPE_DEBUG"):
                traceback.print_exception(exc)
            click.echo(f"error: {describe(exc)}", err=True)
            sys.exit(2)
        internal_error_exit(exc)  # a bug: one line, the traceback only on request


ALLOW_HELP = "a folder outside the recipe's folder and the working directory that the recipe may name (repeatable)"
FACTORY_HELP = "an installed module whose functions the recipe's model.factory may call (repeatable); a factory runs code"


@click.group(cls=OptpipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="optpipe")
def cli() -> None:
    """optpipe: compile a model through a DAG of measured optimization passes."""


@cli.command("compile")
@click.argument("recipes", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RECIPE...")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="run folder (default: the recipe's `output`)")
@click.option("--force", is_flag=True, help="recompute every stage, ignoring the cache")
@click.option("--only", metavar="STAGE", help="run only this stage and its ancestors")
@click.option("--cache-dir", type=click.Path(path_type=Path), help="cache folder (default: $OPTPIPE_CACHE or ~/.cache/optpipe)")
@click.option("--allow-path", "allow_paths", multiple=True, type=click.Path(path_type=Path), help=ALLOW_HELP)
@click.option("--allow-factory", "allow_factories", multiple=True, metavar="MODULE", help=FACTORY_HELP)
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="where stages run: this process, or Ray tasks (pip install 'optpipe[ray]')")
@click.option("--address", metavar="auto|ray://HOST:PORT|HOST:PORT", help="--executor ray: the cluster (default: a local Ray instance)")
@click.option("--yes", is_flag=True, help="run a grid search however many trials it has")
@click.option("--group-by-node", is_flag=True, help="one Pareto frontier per kind of machine, when several measured")
@click.option("--remote-cache", metavar="URL", help="a shared store behind the cache folder: a folder every node mounts (file:///mnt/x or a path) or an object store (s3://bucket/prefix: pip install 'optpipe[s3]'; gs://: gcsfs)")
def compile_command(recipes: tuple[Path, ...], output: Path | None, force: bool, only: str | None, cache_dir: Path | None,
                    allow_paths: tuple[Path, ...], allow_factories: tuple[str, ...], executor: str, address: str | None, yes: bool,
                    group_by_node: bool, remote_cache: str | None) -> None:
    """Run RECIPE: every stage, its evaluation, the report (several recipes: all of them, together)."""
    from optpipe.pass_infra.instruments import ConsoleProgress
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe
    from optpipe.reporting.run_report import stage_table
    from optpipe.recipe.run_paths import RunPaths
    from optpipe.search.space import SearchSpace

    loaded = [load_recipe(path, allow_paths, allow_factories) for path in recipes]
    if address is not None and executor != "ray":
        raise click.UsageError("--address needs --executor ray")
    if len(loaded) > 1 or executor == "ray" or remote_cache or SearchSpace.declared(loaded[0]):
        from optpipe.cli.compile_many import compile_fanned_out

        sys.exit(compile_fanned_out(loaded, executor, address, output, force, only, cache_dir, yes, group_by_node, remote_cache))
    recipe, parsed = recipes[0], loaded[0]
    options = RunOptions(output=output, force=force, only=only, cache_dir=cache_dir, instruments=[ConsoleProgress()])
    report = compile_recipe(parsed, options)
    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    console.print(stage_table(report), markup=False)
    run_dir = RunPaths.resolve(parsed, output).run_dir
    console.print(f"\nreport: {run_dir / 'report.md'}, {run_dir / 'report.html'} (data: report.json)", markup=False)
    from optpipe.cli.failures import failure_lines

    lines, code = failure_lines(report.failed, report.failed_targets)
    for line in lines:
        click.echo(line, err=True)
    if code:
        sys.exit(code)


@cli.command("validate")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--allow-path", "allow_paths", multiple=True, type=click.Path(path_type=Path), help=ALLOW_HELP)
@click.option("--allow-factory", "allow_factories", multiple=True, metavar="MODULE", help=FACTORY_HELP)
def validate_command(recipe: Path, allow_paths: tuple[Path, ...], allow_factories: tuple[str, ...]) -> None:
    """Check RECIPE without running it."""
    from optpipe.plan.dag import execution_order
    from optpipe.recipe.run_paths import RunPaths
    from optpipe.safety.recipe_loading import load_recipe
    from optpipe.plan.validate import validate_recipe

    parsed = load_recipe(recipe, allow_paths, allow_factories)
    RunPaths.for_run(parsed)
    _validate_onnx_source(parsed)
    from optpipe.search.space import SearchSpace

    if SearchSpace.declared(parsed):  # checked trial by trial: a searched param is in no stage's params
        from optpipe.search.driver import describe_search

        click.echo(f"{recipe}: valid; {describe_search(parsed)}")
        return
    graph, _ = validate_recipe(parsed)
    order = execution_order(graph)
    click.echo(f"{recipe}: valid; {len(order)} stages: " + ", ".join(
        f"{n} ({parsed.stages[n].pass_name}{' after ' + parsed.stages[n].after if parsed.stages[n].after else ''})" for n in order
    ))


def _validate_onnx_source(parsed) -> None:
    """An ONNX model file gets the checks a compile's preflight gives it: a lying file is not 'valid'."""
    from optpipe.source.model_source import onnx_path
    from optpipe.safety.preflight import check_onnx_source

    path = onnx_path(parsed.model_source())
    if path is not None:
        check_onnx_source(parsed, path)


@cli.command("passes")
def passes_command() -> None:
    """List the passes with their parameters."""
    from optpipe.passes import registry

    for name, cls in registry().items():
        click.echo(f"{name} (v{cls.version}): {cls.summary()}")
        for field_name, field in cls.Params.model_fields.items():
            default = "" if field.is_required() else f" = {field.get_default(call_default_factory=True)!r}"
            click.echo(f"    {field_name}{default}: {field.description or ''}")


from optpipe.targets.command import export_command  # noqa: E402  (a command in its own module)

cli.add_command(export_command)

from optpipe.cli.inspect_commands import register as _register_inspect  # noqa: E402  (inspect, diff, report)

_register_inspect(cli)

cli.add_command(cache_group)

from optpipe.cli.init_command import init_command  # noqa: E402  (a command in its own module)

cli.add_command(init_command)

from optpipe.cli.serve_command import serve_command  # noqa: E402  (a command in its own module)

cli.add_command(serve_command)


if __name__ == "__main__":
    main()
