"""Where a run writes, resolved once from the recipe and the command line: every layer below
takes these paths instead of re-deriving them from the recipe."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optpipe.cache.store import default_cache_dir
from optpipe.recipe import Recipe


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
