"""`optpipe export RUN_DIR --stage NAME --format ort|tensorrt|triton|openvino --to DIR`: a finished stage
as a deployable artifact, later, without recomputing the run."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from optpipe.targets import KINDS


@click.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--stage", required=True, help="a finished stage of the run (see its report.md)")
@click.option("--format", "kind", required=True, type=click.Choice(KINDS), help="the artifact to write")
@click.option("--to", "to", required=True, type=click.Path(path_type=Path), help="folder to write it into")
@click.option("--cache-dir", type=click.Path(path_type=Path), help="cache folder (default: the recipe's, $OPTPIPE_CACHE or ~/.cache/optpipe)")
@click.option("--allow-out-of-tolerance", is_flag=True, help="export a stage that broke its accuracy tolerance (warns)")
@click.option("--force", is_flag=True, help="write into a folder that holds files optpipe did not write (they may be replaced)")
def export_command(run_dir: Path, stage: str, kind: str, to: Path, cache_dir: Path | None, allow_out_of_tolerance: bool,
                   force: bool) -> None:
    """Write STAGE of the finished run RUN_DIR as an ORT bundle, TensorRT engine, Triton repository or OpenVINO IR."""
    from optpipe.core.errors import TargetError
    from optpipe.targets import export_stage

    if to.exists() and not to.is_dir():
        raise TargetError(f"--to: '{to}' is a file; give a folder to write the {kind} artifact into (new or existing)")
    warnings = check_verdict(run_dir, stage, allow_out_of_tolerance)
    result = export_stage(run_dir, stage, kind, to, cache_dir=cache_dir, force=force)
    # After the export: a refusal (an IR stage in an ONNX format, a bad folder) stays one line, no warnings before it.
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    where = to / result.path if result.path else to
    click.echo(f"{kind} {stage}: {result.describe()}" + (f" -> {where}" if result.ok else ""))
    click.echo(f"manifest: {to / 'manifest.json'}")
    if result.failed:
        sys.exit(1)


def check_verdict(run_dir: Path, stage: str, allow_out_of_tolerance: bool) -> list[str]:
    """Refuse an out-of-tolerance stage unless allowed; the warnings its report carries, to print."""
    from optpipe.core.errors import TargetError
    from optpipe.evaluation.verdict import export_refusal
    from optpipe.core.results import RunReport

    if not (run_dir / "report.json").is_file():
        return []  # export_stage says what is wrong with the folder
    result = RunReport.load(run_dir).stage(stage)
    if result is None:
        return []
    refusal, warnings = export_refusal(result, allow_out_of_tolerance)
    if refusal:
        raise TargetError(refusal)
    return warnings
