"""`optpipe export RUN_DIR --stage NAME --format ort|tensorrt|triton --to DIR`: a finished stage
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
def export_command(run_dir: Path, stage: str, kind: str, to: Path, cache_dir: Path | None) -> None:
    """Write STAGE of the finished run RUN_DIR as an ORT bundle, TensorRT engine or Triton repository."""
    from optpipe.errors import TargetError
    from optpipe.targets import export_stage

    if to.exists() and not to.is_dir():
        raise TargetError(f"--to: '{to}' is a file; give a folder to write the {kind} artifact into (new or existing)")
    result = export_stage(run_dir, stage, kind, to, cache_dir=cache_dir)
    where = to / result.path if result.path else to
    click.echo(f"{kind} {stage}: {result.status}" + (f" -> {where}" if result.ok else ""))
    click.echo(f"manifest: {to / 'manifest.json'}")
    if result.failed:
        sys.exit(1)
