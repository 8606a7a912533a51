"""CLI commands that look at a finished run: inspect, diff, report (views over optpipe.reporting.inspection)."""
from __future__ import annotations

import json
from pathlib import Path

import click


def register(cli: click.Group) -> None:
    for command in (inspect_command, diff_command, report_command):
        cli.add_command(command)


@click.command("inspect")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("stage", required=False)
@click.option("--layers", is_flag=True, help="compare the stage's intermediate tensors with its parent's")
@click.option("--samples", default=2, show_default=True, help="evaluation samples for --layers")
@click.option("--json", "as_json", is_flag=True, help="print the data as JSON")
def inspect_command(run: Path, stage: str | None, layers: bool, samples: int, as_json: bool) -> None:
    """Show a run's stages, or one STAGE: inputs/outputs, ops, bytes by dtype, fused ops, metrics."""
    from optpipe.reporting import inspection, inspection_text

    if stage is None:
        rows = inspection.inspect_run(run)
        click.echo(json.dumps(rows, indent=2) if as_json else inspection_text.render_run(rows))
        if not as_json:
            from optpipe.reporting.search_views import render_trials_text  # a search run: its trials too

            trials = render_trials_text(inspection.open_run(run))
            if trials:  # nothing, not an empty line, for a run that was no search
                click.echo(trials)
        return
    handle = inspection.stage_handle(run, stage)
    data = inspection.inspect_stage(handle)
    comparison = None
    if layers:
        parent = _parent_handle(handle)
        comparison = inspection.layer_comparison(parent, handle, samples)
        data["layers"] = comparison.to_dict()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(inspection_text.render_inspection(data))
    if comparison is not None:
        click.echo("\n" + comparison.render())


@click.command("diff")
@click.argument("first")
@click.argument("second")
@click.argument("third", required=False)
@click.option("--layers", is_flag=True, help="find the first intermediate tensors whose error passes the tolerance")
@click.option("--samples", default=2, show_default=True, help="evaluation samples for --layers")
@click.option("--cosine-min", type=float, help="tolerance for --layers (default: the run's)")
@click.option("--json", "as_json", is_flag=True, help="print the data as JSON")
def diff_command(first: str, second: str, third: str | None, layers: bool, samples: int, cosine_min: float | None, as_json: bool) -> None:
    """What changed from stage A to stage B: ops, nodes, parameters, bytes, accuracy and latency.

    \b
    optpipe diff RUN STAGE_A STAGE_B
    optpipe diff RUN_A:STAGE RUN_B:STAGE
    """
    from optpipe.reporting import inspection, inspection_text
    from optpipe.recipe.schema import Tolerance

    if third is not None:
        run = Path(first)
        inspection.open_run(run)
        a, b = inspection.parse_stage_ref(second, run), inspection.parse_stage_ref(third, run)
    else:
        a, b = inspection.parse_stage_ref(first, None), inspection.parse_stage_ref(second, None)
    tolerance = None
    if cosine_min is not None:
        tolerance = Tolerance(cosine_min=cosine_min)
    diff = inspection.diff_stages(a, b, layers=layers, samples=samples, tolerance=tolerance)
    click.echo(json.dumps(diff.to_dict(), indent=2, default=list) if as_json else inspection_text.render_diff(diff))


@click.command("report")
@click.argument("run", type=click.Path(path_type=Path))
def report_command(run: Path) -> None:
    """Rebuild report.md and report.html of RUN from its report.json (nothing is recomputed)."""
    import tempfile

    from optpipe.core.library_files import keep_library_files_in
    from optpipe.reporting.inspection import open_run
    from optpipe.reporting.run_report import write_report

    report = open_run(run)
    # matplotlib (the plots) keeps a font list; not in home. The run does not say which cache folder it used, and
    # a folder made for it would not be a cache: a temporary one, gone when the report is written.
    with tempfile.TemporaryDirectory(prefix="optpipe-report-") as libraries:
        keep_library_files_in(Path(libraries))
        write_report(report, run)
    click.echo(f"report: {run / 'report.html'} (and report.md)")


def _parent_handle(handle):
    from optpipe.core.errors import RunFolderError
    from optpipe.reporting.inspection import stage_handle

    parent = handle.result.parent
    if parent is None:
        raise RunFolderError(f"stage '{handle.name}' has no parent stage to compare with; use `optpipe diff --layers RUN A B`")
    return stage_handle(handle.run_dir, parent, handle.report)
