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
        return paths


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
