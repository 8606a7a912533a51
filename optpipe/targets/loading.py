"""`optpipe.load`: a ready runtime object from a folder a target (or `optpipe export`) wrote."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def load(path: str | Path, **options: Any):
    """An OpenVINO folder (openvino.json beside model.xml) -> openvino.CompiledModel with the measured
    settings (option: threads); an ORT bundle -> onnxruntime.InferenceSession (options: format, providers)."""
    folder = Path(path)
    if not folder.exists():
        from optpipe.core.errors import TargetError

        raise TargetError(f"'{path}' does not exist; pass the folder a target or `optpipe export` wrote")
    folder = folder.parent if folder.is_file() else folder
    if (folder / "model.xml").is_file():  # an IR: load_ir says what is missing, if anything
        from optpipe.core.errors import TargetError
        from optpipe.targets.openvino import load_ir

        unknown = sorted(set(options) - {"threads"})
        if unknown:  # an ORT bundle's options (providers, format) mean nothing to an IR
            raise TargetError(f"optpipe.load of an OpenVINO folder takes `threads` only; got {', '.join(unknown)}")

        return load_ir(folder, **options)
    from optpipe.targets.ort_bundle import load_bundle

    return load_bundle(path, **options)
