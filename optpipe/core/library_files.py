"""Where the libraries optpipe runs keep their own files: inside the cache folder, not the user's home.

A compile touches nothing outside its output and cache folders, but the libraries it calls keep
state of their own by default (measured with an empty HOME and TMPDIR, a tiny recipe through export,
int8, openvino and the report):
- ONNX Runtime 1.31's POSIX telemetry writes a device id and an event database under
  ~/.cache/Microsoft/DeveloperTools/.onnxruntime and a session file in TMPDIR on `import onnxruntime`,
  and uploads events. ORT_DISABLE_TELEMETRY=1 (read once, before ORT starts) creates none of them.
- matplotlib (the report's plots) writes its font list to ~/.cache/matplotlib: MPLCONFIGDIR.
- torch.export leaves TMPDIR/torchinductor_<user>: TORCHINDUCTOR_CACHE_DIR.
- transformers copies a Hugging Face folder's own modeling code (`trust_remote_code: true`) into
  ~/.cache/huggingface/modules before importing it: HF_MODULES_CACHE (read when transformers is imported).
A value the user set is kept. These are the libraries' documented environment switches; OpenVINO's
and NNCF's telemetry is handled where they are called (evaluation/openvino_runtime.py)."""
from __future__ import annotations

import os
from pathlib import Path

ORT_TELEMETRY_OFF = ("ORT_DISABLE_TELEMETRY", "1")


def ort_telemetry_off() -> None:
    """Before onnxruntime is first imported (optpipe's import does this)."""
    os.environ.setdefault(*ORT_TELEMETRY_OFF)


def keep_library_files_in(cache_root: Path) -> None:
    """Point the libraries' own caches under the run's cache folder (its tmp/, which gc never reads)."""
    ort_telemetry_off()
    folder = cache_root / "tmp" / "libraries"
    os.environ.setdefault("MPLCONFIGDIR", str(folder / "matplotlib"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "torchinductor"))
    os.environ.setdefault("HF_MODULES_CACHE", str(folder / "hf_modules"))
