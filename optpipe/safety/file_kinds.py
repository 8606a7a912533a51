"""What a model file that is not ONNX is, from its first bytes, and the recipe that takes it.

A user handed a PyTorch checkpoint, a safetensors file or a TFLite model as `model: {onnx: ...}` (or to `optpipe
init`) got "not an ONNX model or is truncated; export it again": true, and no help. The formats' own signatures
say which it is (read here from a few bytes: no library loads the file)."""
from __future__ import annotations

import zipfile
from pathlib import Path

FACTORY = "`model: {factory: module:function, checkpoint: FILE}` (the function builds the module, the file fills it)"
TORCHSCRIPT = "`model: {torchscript: FILE}` (or `optpipe init FILE`)"


def other_model_format(path: Path) -> str | None:
    """'<what the file is>; <what to give instead>', or None when the bytes say nothing known."""
    try:
        with path.open("rb") as handle:
            head = handle.read(64)
    except OSError:
        return None
    if path.name == "config.json":
        return "a Hugging Face model's config.json; give its folder"
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):  # no central directory at the end: cut short
            return "a zip archive cut short or damaged (a torch.save, TorchScript or npz file?); write it again"
        return _zip_kind(path)
    if _is_safetensors(head):
        return (f"safetensors weights; give the Hugging Face folder that holds them with its config.json, or use {FACTORY}")
    if head.startswith(b"GGUF"):
        return "a GGUF checkpoint; scripts/gguf_to_hf.py turns it into a Hugging Face folder, the recipe's `hf` source"
    if head[4:8] == b"TFL3":
        return "a TensorFlow Lite model; convert it to ONNX first (tf2onnx --tflite)"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "a Keras HDF5 model; convert it to ONNX first (tf2onnx)"
    if head.lstrip().startswith(b"<?xml") and b"<net" in head:
        return "an OpenVINO IR; give the ONNX file or PyTorch model it was converted from"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return f"a pickled file (an old torch.save); use {FACTORY} with `allow_pickle: true` if you trust it"
    return None


def _zip_kind(path: Path) -> str:
    """torch.jit.save and torch.save both write zips: the archive holds the module's code, the checkpoint a data.pkl."""
    names = _zip_names(path)
    if _holds_code(names):
        return f"a TorchScript archive; use {TORCHSCRIPT}"
    if any(name.endswith("data.pkl") for name in names):
        return f"a PyTorch checkpoint (torch.save); use {FACTORY}"
    if names and all(name.endswith(".npy") for name in names):
        return "a NumPy .npz of arrays: data, not a model (`data: {source: npz, path: FILE}`)"
    return "a zip archive of other files"


def is_torchscript_archive(path: Path) -> bool:
    """A zip torch.jit.save wrote: it holds the module's code (`<archive>/code/`)."""
    return _holds_code(_zip_names(path))


def _holds_code(names: list[str]) -> bool:
    return any("/code/" in name or name.startswith("code/") for name in names)


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def _is_safetensors(head: bytes) -> bool:
    """An 8-byte little-endian header length, then the JSON header itself."""
    if len(head) < 10:
        return False
    length = int.from_bytes(head[:8], "little")
    return 2 <= length < 100_000_000 and head[8:10] == b'{"'
