"""Where a run writes, resolved once from the recipe and the command line: every layer below
takes these paths instead of re-deriving them from the recipe."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from optpipe.cache.folder import check_apart
from optpipe.core.errors import RunFolderError
from optpipe.cache.store import default_cache_dir
from optpipe.recipe.schema import Recipe


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path
    cache_dir: Path

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @classmethod
    def resolve(cls, recipe: Recipe, output: Path | None = None, cache_dir: Path | None = None) -> "RunPaths":
        """The command line's folders first, else the recipe's (relative to its file), else $OPTPIPE_CACHE's."""
        return cls(
            run_dir=output or recipe.resolve(recipe.output),
            cache_dir=cache_dir or (recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir()),
        )

    @classmethod
    def for_run(cls, recipe: Recipe, output: Path | None = None, cache_dir: Path | None = None) -> "RunPaths":
        """The folders a run will write, refused when one is inside the other (`cache gc` would remove a
        run, or a run folder the cache). Every way to start a run resolves its folders here: the CLI,
        `compile_recipe`, `compile_recipes` and `validate`."""
        paths = cls.resolve(recipe, output, cache_dir)
        check_apart(paths.run_dir, paths.cache_dir)
        check_no_links(paths.run_dir)
        check_not_foreign(paths.run_dir)
        return paths


#: What a run writes in its folder. A folder holding one of them that is no run's would have it written over.
RUN_ENTRIES = ("report.json", "report.md", "report.html", "recipe.json", "eval_inputs.npz", "logs", "stages", "targets")
#: Left in a run folder when a run starts: a run cut short before its report is still known as a run's folder.
RUN_MARKER = ".optpipe-run"


def mark_run_folder(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARKER).touch()


def check_not_foreign(run_dir: Path) -> None:
    """`output: .` beside the recipe, or a project folder: the run wrote its report.md and logs/ over the user's own
    files of those names (and would replace a `stages/<name>/` folder), without a word. Refused before anything is
    written, naming them; a folder an earlier run wrote (its marker, lock or report) is the run's to update."""
    if not run_dir.is_dir() or _is_run_folder(run_dir):
        return
    clashes = [name for name in RUN_ENTRIES if (run_dir / name).exists()]
    if clashes:
        raise RunFolderError(
            f"output folder '{run_dir}' is not an optpipe run folder and holds {', '.join(clashes)}, which a run would write "
            "over: give `output` in the recipe (or --output) a new or empty folder")


def _is_run_folder(run_dir: Path) -> bool:
    if (run_dir / RUN_MARKER).exists() or (run_dir / ".optpipe.lock").exists():
        return True
    try:  # a run of a version before the marker: its report names optpipe in its first lines (a report can be MBs)
        with open(run_dir / "report.json", "rb") as report:
            return b'"optpipe_version"' in report.read(4096)
    except OSError:
        return False


def check_no_links(run_dir: Path) -> None:
    """A symlink inside a run folder (`logs` -> a folder elsewhere, `report.json` -> ~/.bashrc) would carry
    optpipe's writes outside it: refused before anything is written, naming the link. optpipe itself puts
    only real files and folders there (stage copies are copies, not links)."""
    if not run_dir.is_dir():
        return
    for folder, dirs, files in os.walk(run_dir):  # os.walk does not enter linked folders: they are listed, and refused
        for name in sorted(dirs + files):
            path = Path(folder, name)
            if path.is_symlink():
                raise RunFolderError(
                    f"'{path}' in the run folder is a symlink (to {os.readlink(path)}); optpipe would write through it, "
                    "outside the run folder: remove the link, or choose another --output"
                )
