"""The calibration result cache: ONNX Runtime's tensor ranges, keyed by what produced them.

ORT's `quantize_static(calibration_cache_path=...)` reuses any existing file without
checking the model or the data, so the file's name here is the key: a hash of the
model's content, the calibration set's key (which covers the data file's content),
the method and its options, and the op types whose inputs are calibrated. Changing
any of them points to a different file; a second run with the same ones finds the
file and ORT skips calibration.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from optpipe.core.artifact import sha256_json
from optpipe.cache.store import library_versions

RANGES_FORMAT = 1


@dataclass(frozen=True)
class CalibrationRanges:
    """Where a model's ranges live in the cache, and whether they were already there."""

    path: Path
    key: str
    cached: bool


def ranges_key(model_hash: str, samples_key: str, method: str, op_types: list[str] | None, options: dict[str, Any]) -> str:
    return sha256_json(
        {
            "format": RANGES_FORMAT,
            "model": model_hash,
            "samples": samples_key,
            "method": method,
            "op_types": sorted(op_types) if op_types else None,
            "options": options,
            # The calibrator's statistics (histograms, percentiles) come from ORT's code.
            "libraries": library_versions(("onnxruntime", "onnxruntime-gpu")),
        }
    )


class CalibrationCache:
    """`<cache>/calibration/<key>.json` files in ORT's own calibration-cache format."""

    def __init__(self, cache_dir: Path):
        self.folder = cache_dir / "calibration"
        self.folder.mkdir(parents=True, exist_ok=True)

    def ranges(self, key: str) -> CalibrationRanges:
        path = self.folder / f"{key}.json"
        return CalibrationRanges(path=path, key=key, cached=path.is_file() and path.stat().st_size > 0)

    def lock(self, key: str) -> FileLock:
        """Held while calibrating, so two stages never compute the same ranges at once."""
        return FileLock(str(self.folder / f"{key}.lock"))

    def discard(self, key: str) -> None:
        (self.folder / f"{key}.json").unlink(missing_ok=True)
