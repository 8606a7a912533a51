"""The manifest: every artifact a run (or an export) wrote, with its stage, precision, accuracy,
latency, the provider that measured them, and the hashes of its files."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from optpipe.core.results import TargetResult
from optpipe.hardware.cpu_features import cpu_record

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
