"""The run folder's copies of the stage models: `<run>/stages/<name>/`, each with its manifest.

Each copy carries the cache entry's manifest (`entry.json`: every file's hash), so a
user or `optpipe cache verify --run` can check it. A copy that no longer matches
its manifest (edited, truncated) is reported and restored from the cache.

A copy is written into a hidden sibling folder and renamed into place: a publish cut
short (Ctrl-C, SIGKILL, a full disk) leaves the previous copy or none, never half of
one. The callers hold the run folder's lock, so the next publish may sweep what a cut
one left.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from optpipe.core.artifact import MANIFEST_FILE, copy_file
from optpipe.cache.store import verify_entry
from optpipe.core.results import StageResult

log = logging.getLogger("optpipe.run")


def publish_stage_folders(run_dir: Path, results: list[StageResult]) -> None:
    """Each finished stage's model appears under <run>/stages/<name>/ (copied from the cache)."""
    _sweep_cut_publishes(run_dir / "stages")
    for result in results:
        model = result.model
        target = run_dir / "stages" / result.name
        if model is None:
            _drop_stale_copy(target, result)
            continue
        result.artifact = str(target / "model.onnx")
        if not _is_intact_copy(target, model.folder, result.name):
            _replace_folder(target, model.files())


def _drop_stale_copy(target: Path, result: StageResult) -> None:
    """A stage this run has no model for (skipped on this CPU, failed) keeps no copy from an earlier
    run: its folder would pass for this run's output (seen: a native ov-int8 left beside a run that
    skipped it on the AVX2 class). Only optpipe's own copies (with their manifest) go; the cache keeps
    the entry."""
    if (target / MANIFEST_FILE).is_file():
        log.info("run folder: removed the copy of stage '%s' left by an earlier run (%s now)", result.name, result.status)
        shutil.rmtree(target, ignore_errors=True)


def _replace_folder(target: Path, files) -> None:
    """target's files become `files`, by two renames: the folder is whole before and after either."""
    staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    old = staging.with_name(staging.name + ".old")
    try:
        for file in files:
            copy_file(file, staging / file.name)
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
    finally:
        for leftover in (staging, old):
            shutil.rmtree(leftover, ignore_errors=True)


def _sweep_cut_publishes(stages: Path) -> None:
    for leftover in stages.glob(".*.tmp*") if stages.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def verify_run_folder(run_dir: Path) -> dict[str, str | None]:
    """Per stage copy in a run folder: None when it matches its manifest, else what is wrong."""
    stages = run_dir / "stages"
    return {folder.name: verify_entry(folder) for folder in sorted(stages.iterdir())
            if folder.is_dir() and not folder.name.startswith(".")} if stages.exists() else {}


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
