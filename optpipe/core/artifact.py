"""A model artifact: an ONNX file, its external data, and what the pass that made it recorded.

An artifact is a folder. `model.onnx` always keeps its weights in `model.onnx.data`
beside it (also for small models) so that every stage looks the same, and hashes
cover both files.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import external_data_helper

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
INFO_FILE = "info.json"
MANIFEST_FILE = "entry.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def content_hash(file_hashes: dict[str, str]) -> str:
    """One hash for a model from its files' hashes (info.json excluded: it describes, it is not the model)."""
    return sha256_json({name: h for name, h in file_hashes.items() if name != INFO_FILE})


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class ModelArtifact:
    """A folder holding model.onnx (+ model.onnx.data) and info.json. Treated as read-only."""

    folder: Path
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def path(self) -> Path:
        return self.folder / MODEL_FILE

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.is_file())

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files() if p.name != INFO_FILE)

    def content_hash(self) -> str:
        """Hash of the model and all its external data (not the info or the cache manifest).

        A cache entry records it in its manifest (verified on lookup), so it is read, not recomputed.
        """
        manifest = self.folder / MANIFEST_FILE
        if manifest.exists():
            try:
                return json.loads(manifest.read_text())["content"]
            except (ValueError, KeyError):
                pass
        return content_hash({p.name: sha256_file(p) for p in self.files() if p.name not in (INFO_FILE, MANIFEST_FILE)})

    def load(self, with_weights: bool = True) -> onnx.ModelProto:
        return onnx.load(str(self.path), load_external_data=with_weights)

    @classmethod
    def open(cls, folder: Path) -> "ModelArtifact":
        info_path = folder / INFO_FILE
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        return cls(folder=folder, info=info)


def all_graphs(graph: onnx.GraphProto):
    """`graph` and every subgraph in it (If / Loop / Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from all_graphs(sub)


def save_model(model: onnx.ModelProto, folder: Path, info: dict[str, Any] | None = None) -> ModelArtifact:
    """Write a model as an artifact folder; weights always go to external data.

    onnx moves the tensors' bytes out of `model` while saving: reload the artifact
    rather than reusing the proto afterwards.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / MODEL_FILE, folder / DATA_FILE):
        stale.unlink(missing_ok=True)
    # What onnx.save_model(save_as_external_data=True, location=DATA_FILE, size_threshold=1024) does,
    # less its check that `location` does not exist, which onnx makes against the working directory,
    # not the model's folder: a user's own model.onnx.data where optpipe runs failed every pass.
    for tensor in (init for sub in all_graphs(model.graph) for init in sub.initializer):  # as onnx's conversion walks them
        if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= 1024:
            external_data_helper.set_external_data(tensor, DATA_FILE)
    onnx.save_model(model, str(folder / MODEL_FILE))  # writes the external tensors beside it
    if not (folder / DATA_FILE).exists():
        (folder / DATA_FILE).write_bytes(b"")  # keep the pair even when every tensor was tiny
    return write_info(folder, info or {})


def adopt_model(path: Path, folder: Path, info: dict[str, Any] | None = None) -> ModelArtifact:
    """`path`, an ONNX file whose external tensors all live in one data file beside it (torch.onnx's dynamo
    export writes that), moved into `folder` as its artifact: the data file renamed to model.onnx.data and
    the graph's locations rewritten, the weights never read. save_model(onnx.load(path)) would hold them in
    memory twice over (Gemma 3 270M's KV-cache export: its save step peaked 1.1-1.8 GB above the export's).
    Tensors stay where the writer put them (small ones inline); any other layout goes through save_model."""
    model = onnx.load(str(path), load_external_data=False)
    tensors = list(_tensors(model.graph))
    external = [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]
    locations = {next((e.value for e in t.external_data if e.key == "location"), "") for t in external}
    location = next(iter(locations)) if len(locations) == 1 else None
    source = path.parent / location if location and Path(location).name == location else None  # a plain file name only
    inline = any(t.data_location != onnx.TensorProto.EXTERNAL and sys.getsizeof(t.raw_data) >= 1024 for t in tensors)
    if inline or (locations and (source is None or not source.is_file())):  # save_model's layout, its checks
        return save_model(onnx.load(str(path)), folder, info)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / MODEL_FILE, folder / DATA_FILE):
        stale.unlink(missing_ok=True)
    if source is not None:
        os.replace(source, folder / DATA_FILE)
    else:
        (folder / DATA_FILE).write_bytes(b"")  # keep the pair even when every tensor is inline
    for entry in (e for t in external for e in t.external_data if e.key == "location"):
        entry.value = DATA_FILE  # offsets and lengths stand: the file is the same bytes under another name
    onnx.save_model(model, str(folder / MODEL_FILE))  # the graph only: the tensors stay external
    return write_info(folder, info or {})


def _tensors(graph: onnx.GraphProto):
    """Every tensor that can carry external data: initializers and Constant-style attributes, subgraphs included."""
    for sub in all_graphs(graph):
        yield from sub.initializer
        for node in sub.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def write_info(folder: Path, info: dict[str, Any]) -> ModelArtifact:
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True, default=str))
    return ModelArtifact(folder=folder, info=info)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file so readers see the old or the new content, never half (temp file, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk or a Ctrl-C leaves no half temp file behind
        raise


def copy_file(src: Path, dst: Path) -> None:
    """Copy a file, skipping the copy when dst already holds the same bytes.

    Not a hard link: onnx refuses external data files with several links (a
    guard against hard-link attacks), so run folders hold real copies.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha256_file(src):
        return
    # A private temp name: two processes publishing one run folder never write the same temp file.
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
