"""The manifest: every artifact a run (or an export) wrote, with its stage, precision, accuracy,
latency, the provider that measured them, and the hashes of its files."""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from optpipe.core.errors import TargetError
from optpipe.core.results import TargetResult
from optpipe.hardware.cpu_features import cpu_record
from optpipe.recipe.run_paths import check_no_links

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 2  # 2: status and reason apart


def write_manifest(folder: Path, recipe: str, results: list[TargetResult]) -> Path:
    """manifest.json in `folder`; artifact paths in it are relative to `folder`."""
    document = {
        "format": MANIFEST_FORMAT,
        "recipe": recipe,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_record(),  # the CPU class the artifacts were chosen and measured on (int8 formats differ per class)
        "artifacts": [manifest_entry(r) for r in results],
    }
    path = folder / MANIFEST_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=2))
    tmp.replace(path)
    return path


def manifest_entry(result: TargetResult) -> dict:
    accuracy = result.accuracy
    return {
        "target": result.kind,
        "stage": result.stage,
        "status": result.status,
        "reason": result.reason,
        "path": result.path,
        "precision": result.precision,
        "provider": result.provider,
        "accuracy": None if accuracy is None else {
            "reference": accuracy.reference,
            "worst_cosine": accuracy.worst_cosine,
            "max_abs": max((o.max_abs for o in accuracy.outputs), default=None),
            "within_tolerance": accuracy.within_tolerance,
        },
        "latency": [
            {"batch_size": lat.batch_size, "p50_ms": lat.p50_ms, "p90_ms": lat.p90_ms, "p99_ms": lat.p99_ms,
             "throughput": lat.throughput, "provider": lat.provider, "cpu_class": lat.cpu_class}
            for lat in result.latency
        ],
        "hash": result.hash,
        "files": result.files,
        "built_on": result.built_on,  # the node (host, CPU, GPUs) a Ray task built it on; None: the driver's machine
        "gpu_check": result.gpu_check,  # gpu_type: the GPU it was built on against the one it is meant for
    }


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_FILE).read_text())


def is_ours(folder: Path) -> bool:
    """The folder holds a manifest optpipe wrote (an earlier export or run): its files are optpipe's to replace."""
    try:
        document = read_manifest(folder)
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and isinstance(document.get("format"), int) and isinstance(document.get("artifacts"), list)


def check_export_folder(to: Path, cache_root: Path, force: bool) -> None:
    """`export --to` follows the rules of `compile --output`: not a file, not inside the cache (where `cache gc`
    would remove it) nor holding it, no symlink inside; and a folder optpipe did not write (files, no manifest)
    is the user's: its files are not replaced unless `--force` says so."""
    if to.exists() and not to.is_dir():
        raise TargetError(f"--to: '{to}' is a file; give a folder to write the artifact into (new or existing)")
    target, cache = (Path(os.path.realpath(p.expanduser())) for p in (to, cache_root))
    if target == cache or target.is_relative_to(cache):
        raise TargetError(f"--to: '{to}' is inside the cache '{cache_root}', where `cache gc` would remove it; choose a folder outside the cache")
    if cache.is_relative_to(target):
        raise TargetError(f"--to: the cache '{cache_root}' is inside '{to}'; choose a folder that does not hold the cache")
    if not to.is_dir():
        return
    check_no_links(to)
    if not force and any(to.iterdir()) and not is_ours(to):
        raise TargetError(f"--to: '{to}' holds files optpipe did not write (no {MANIFEST_FILE}); choose a new or empty "
                          "folder, or pass --force to write over them")
