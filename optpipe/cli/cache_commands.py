"""`optpipe cache ls|gc|verify`: see, prune and check the cache (registered in cli.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

CACHE_DIR_HELP = "cache folder (default: $OPTPIPE_CACHE or ~/.cache/optpipe)"


@click.group("cache")
@click.option("--cache-dir", type=click.Path(path_type=Path), help=CACHE_DIR_HELP)
@click.pass_context
def cache_group(ctx: click.Context, cache_dir: Path | None) -> None:
    """List, prune and verify the cache."""
    from optpipe.cache.folder import require_marked
    from optpipe.cache.store import default_cache_dir

    ctx.obj = cache_dir or default_cache_dir()
    require_marked(ctx.obj)  # a folder that is not an optpipe cache is refused before anything is removed


@cache_group.command("ls")
@click.option("--kind", help="only this kind of entry (stages, datasets, results, ...)")
@click.pass_obj
def ls_command(root: Path, kind: str | None) -> None:
    """List entries: kind, key, size, time since last use, what made them."""
    from optpipe.cache.admin import human_age, human_size, list_entries

    entries = [e for e in list_entries(root) if kind is None or e.kind == kind]
    for e in entries:
        click.echo(f"{e.kind:<9} {e.key[:12]}  {human_size(e.size):>9}  {human_age(e.age_s):>4} ago  {e.label}")
    click.echo(f"{len(entries)} entries, {human_size(sum(e.size for e in entries))} in {root}")


@cache_group.command("gc")
@click.option("--older-than", "older_than", metavar="AGE", help="remove entries unused for longer than AGE (e.g. 12h, 7d, 2w)")
@click.option("--max-size", "max_size", metavar="SIZE", help="then remove the least recently used until the cache fits SIZE (e.g. 20G)")
@click.option("--dry-run", is_flag=True, help="say what would be removed, remove nothing")
@click.pass_obj
def gc_command(root: Path, older_than: str | None, max_size: str | None, dry_run: bool) -> None:
    """Prune entries by age and size; entries a running compile uses are kept."""
    from optpipe.cache.admin import collect_garbage, human_size, parse_age, parse_size
    from optpipe.core.errors import OptpipeError

    if older_than is None and max_size is None:
        raise OptpipeError("cache gc: give --older-than AGE and/or --max-size SIZE")
    result = collect_garbage(root, parse_age(older_than) if older_than else None, parse_size(max_size) if max_size else None, dry_run)
    verb = "would remove" if dry_run else "removed"
    for e in result.removed:
        click.echo(f"{verb} {e.kind}/{e.key[:12]} ({human_size(e.size)}) {e.label}")
    busy = f"; kept {len(result.busy)} in use by a running compile" if result.busy else ""
    click.echo(f"{verb} {len(result.removed)} entries ({human_size(sum(e.size for e in result.removed))}){busy}; "
               f"{human_size(result.kept_bytes)} left; {result.leftovers} leftovers of killed runs swept")


@cache_group.command("verify")
@click.option("--delete", is_flag=True, help="remove the entries that fail (they are recomputed when needed)")
@click.option("--run", "run_dirs", multiple=True, type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="also verify the stage copies in this run folder (repeatable)")
@click.pass_obj
def verify_command(root: Path, delete: bool, run_dirs: tuple[Path, ...]) -> None:
    """Re-hash every entry against its manifest; exit 1 if any is corrupted."""
    from optpipe.cache.admin import list_entries, remove, verify
    from optpipe.execution.run_folder import verify_run_folder

    entries = list_entries(root)
    bad = 0
    for e in entries:
        problem = verify(e)
        if problem:
            bad += 1
            gone = " (removed)" if delete and remove(root, e) else ""
            click.echo(f"corrupted {e.kind}/{e.key[:12]}: {problem}{gone}")
    checked = len(entries)
    for run_dir in run_dirs:
        for stage, problem in verify_run_folder(run_dir).items():
            checked += 1
            if problem:
                bad += 1
                click.echo(f"corrupted {run_dir}/stages/{stage}: {problem}; rerun the compile to restore it")
    click.echo(f"verified {checked} entries: {checked - bad} ok, {bad} corrupted")
    if bad:
        sys.exit(1)
