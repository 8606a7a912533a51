"""The run folder's copies of the stage models: `<run>/stages/<name>/`, each with its manifest.

Each copy carries the cache entry's manifest (`entry.json`: every file's hash), so a
user or `optpipe cache verify --run` can check it. A copy that no longer matches
its manifest (edited, truncated) is reported and restored from the cache.
"""
from __future__ import annotations

import logging
from pathlib import Path

from optpipe.artifact import MANIFEST_FILE, copy_file
from optpipe.cache.store import verify_entry
from optpipe.results import StageResult

log = logging.getLogger("optpipe.run")


def publish_stage_folders(run_dir: Path, results: list[StageResult]) -> None:
    """Each finished stage's model appears under <run>/stages/<name>/ (copied from the cache)."""
    for result in results:
        model = result.model
        if model is None:
            continue
        target = run_dir / "stages" / result.name
        result.artifact = str(target / "model.onnx")
        if _is_intact_copy(target, model.folder, result.name):
            continue  # same manifest, every file verified against it: nothing to copy or hash again
        wanted = {file.name for file in model.files()}
        for stale in target.glob("*") if target.exists() else []:
            if stale.name not in wanted and stale.is_file():
                stale.unlink()
        # The manifest last: a copy interrupted half way has an old or no manifest, and fails verification.
        files = sorted(model.files(), key=lambda f: f.name == MANIFEST_FILE)
        for file in files:
            copy_file(file, target / file.name)


def verify_run_folder(run_dir: Path) -> dict[str, str | None]:
    """Per stage copy in a run folder: None when it matches its manifest, else what is wrong."""
    stages = run_dir / "stages"
    return {folder.name: verify_entry(folder) for folder in sorted(stages.iterdir()) if folder.is_dir()} if stages.exists() else {}


def _is_intact_copy(target: Path, source: Path, stage: str) -> bool:
    """True when the run folder already holds this cache entry, verified; warns when a copy was modified."""
    manifest = target / MANIFEST_FILE
    if not manifest.exists():
        return False
    problem = verify_entry(target)
    if problem:
        log.warning("run folder copy of stage '%s' was modified (%s); restoring it from the cache", stage, problem)
        return False
    return manifest.read_bytes() == (source / MANIFEST_FILE).read_bytes()
