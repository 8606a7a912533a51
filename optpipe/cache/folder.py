"""Which folder is a cache: marked when optpipe creates it, refused by the cache commands otherwise.

`cache gc` and `cache verify --delete` remove files. Pointed at the wrong folder (an
empty OPTPIPE_CACHE used to mean the working directory) they removed a project's
sources. So a cache carries a marker, CACHEDIR.TAG (the Cache Directory Tagging
Specification, which backup tools also honour), written when optpipe creates the
folder; the commands that remove anything act only on a marked folder, and a run
folder and a cache may not nest (pruning one would remove the other).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from optpipe.core.artifact import write_text_atomic
from optpipe.core.errors import OptpipeError

MARKER = "CACHEDIR.TAG"
SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_MARKER_TEXT = (
    f"{SIGNATURE}\n"
    "# This folder is an optpipe cache, created by optpipe.\n"
    "# `optpipe cache` commands act only on folders that carry this file.\n"
)
_OURS = "optpipe cache"
# Entry names are sha256 keys (hex); results add `.json`.
KEY_NAME = re.compile(r"[0-9a-f]{32,128}(\.json)?")
# Bookkeeping folders of a cache; everything else at the top level is a kind of entry.
SERVICE_DIRS = ("tmp", "locks")
# What every cache made by optpipe holds, from before the marker existed.
OLD_LAYOUT = ("stages", "results", *SERVICE_DIRS)


class CacheFolderError(OptpipeError):
    """A cache folder that optpipe must not use or prune (exit code 2)."""


def is_marked(root: Path) -> bool:
    try:
        return _OURS in (root / MARKER).read_text(encoding="utf-8", errors="replace")[:4096]
    except OSError:
        return False


def prepare_cache_folder(root: Path) -> None:
    """Create and mark a new cache; accept a marked one, or an unmarked one with a cache's layout
    (made before the marker existed); refuse any other folder that is not empty."""
    if root.exists() and not root.is_dir():
        raise CacheFolderError(f"cache folder '{root}' is a file; point --cache-dir or OPTPIPE_CACHE at a folder")
    if not is_marked(root):
        stranger = _first_stranger(root) if root.exists() else None
        if stranger is not None and stranger.name == MARKER:
            # Not ours: most likely ours half-written (a full disk left it empty), or another tool's.
            raise CacheFolderError(
                f"cache folder '{root}' holds a {MARKER} that optpipe did not write (empty or another tool's); "
                f"delete '{root / MARKER}' if this folder is an optpipe cache, else point --cache-dir or OPTPIPE_CACHE elsewhere"
            )
        if stranger is not None:
            raise CacheFolderError(
                f"cache folder '{root}' is not an optpipe cache (it holds '{stranger.name}'); point --cache-dir or "
                "OPTPIPE_CACHE at an empty folder or one optpipe created"
            )
        root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(root / MARKER, _MARKER_TEXT)  # a full disk leaves no half marker behind


def require_marked(root: Path) -> bool:
    """For commands that prune: True when `root` is a marked cache, False when it does not exist;
    any other folder is refused."""
    if not root.exists():
        return False
    if not root.is_dir() or not is_marked(root):
        raise CacheFolderError(
            f"'{root}' is not an optpipe cache (no {MARKER} written by optpipe{_marker_hint(root)}); cache commands only act on folders "
            "optpipe created: check --cache-dir and OPTPIPE_CACHE (a cache made by an older optpipe is marked by its next compile)"
        )
    return True


def check_apart(run_dir: Path, cache_root: Path) -> None:
    """A run folder inside the cache (or the reverse) would be removed by `cache gc`: refuse it."""
    # realpath, not Path.resolve: a symlink loop is reported when the folder is created, not as a RuntimeError
    run, cache = (Path(os.path.realpath(p.expanduser())) for p in (run_dir, cache_root))
    if run == cache or run.is_relative_to(cache):
        raise CacheFolderError(
            f"the run folder '{run_dir}' is inside the cache '{cache_root}', where `cache gc` would remove it; choose "
            "an --output outside the cache"
        )
    if cache.is_relative_to(run):
        raise CacheFolderError(
            f"the cache '{cache_root}' is inside the run folder '{run_dir}'; keep the cache elsewhere (--cache-dir, "
            "OPTPIPE_CACHE or the recipe's `cache`)"
        )


def _marker_hint(root: Path) -> str:
    marker = root / MARKER
    return f"; if it is one, delete the foreign '{marker}' and compile once" if marker.exists() else ""


def is_entry_name(name: str) -> bool:
    return KEY_NAME.fullmatch(name) is not None


def _first_stranger(root: Path) -> Path | None:
    """None when `root` may become a cache: empty, or laid out as every optpipe cache has been
    (stages/, results/, tmp/, locks/ folders, no files beside them); else the first thing in it."""
    children = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    if not children:
        return None
    files = [p for p in children if not p.is_dir()]
    if not files and all((root / name).is_dir() for name in OLD_LAYOUT):
        return None
    return files[0] if files else next((p for p in children if p.name not in OLD_LAYOUT), children[0])
