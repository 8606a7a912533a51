"""One in-process memo of an ONNX model's outputs on a list of input batches.

In one compile the same model runs on the same evaluation batches several times: a lossy
pass's guard computes its input's outputs (two int8 stages after `fuse` both compute
`fuse`'s), OpenVINO's input check computes `simplify`'s, and the evaluation computes every
stage's again, including the guard's final model, which the guard's last measurement ran.
`run_onnx` asks this memo first.

The key is everything that decides the numbers: the model's bytes (the .onnx file and every
external-data file it names), the input arrays (names, dtypes, shapes, bytes, in batch order),
and the ONNX Runtime session (providers, threads, graph optimization level, execution mode).
The model is keyed by content, not path: the same files in a cache entry or in a scratch
folder hash alike, so a model published into the cache reuses what was computed on its copy.

Bounded: an LRU with a byte cap; a value bigger than the cap is not kept. Values are read-only
arrays (`writeable=False`): a caller that changed one in place would corrupt every later hit,
so it raises instead. One memo per process (a Ray worker has its own); functools.lru_cache
cannot bound by bytes nor key on file contents, hence this small class.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from optpipe.core.artifact import DATA_FILE, MANIFEST_FILE, MODEL_FILE, content_hash, sha256_file, sha256_json
from optpipe.core.runtime import Feeds, Outputs

log = logging.getLogger("optpipe.memo")

#: MiniLM's outputs on the 64 evaluation samples are ~13 MB; an LM's can be GBs (then not kept).
DEFAULT_CAP_BYTES = 512 * 1024 * 1024
KEY_FORMAT = 1


class OutputsMemo:
    """LRU of outputs by key, at most `cap_bytes` of arrays; counts hits, misses and the seconds hits saved."""

    def __init__(self, cap_bytes: int = DEFAULT_CAP_BYTES):
        self.cap_bytes = cap_bytes
        self._entries: OrderedDict[str, tuple[Outputs, int, float]] = OrderedDict()  # key -> outputs, bytes, seconds
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.saved_s = 0.0

    def get(self, key: str) -> Optional[Outputs]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            outputs, _, seconds = entry
            self.hits += 1
            self.saved_s += seconds
        return dict(outputs)  # a new dict: a caller may add or drop names without touching the memo

    def put(self, key: str, outputs: Outputs, seconds: float) -> bool:
        """Keep `outputs` (made read-only); False when it alone exceeds the cap (not kept)."""
        frozen = freeze(outputs)
        size = sum(array.nbytes for array in frozen.values())
        if size > self.cap_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (frozen, size, seconds)
            self.bytes += size
            while self.bytes > self.cap_bytes:
                _, (_, evicted, _) = self._entries.popitem(last=False)
                self.bytes -= evicted
        return True

    def outputs(self, key: Optional[str], compute: Callable[[], Outputs], what: str) -> Outputs:
        """The memo's value for `key`, else `compute()`'s (kept). No key: computed, not kept."""
        if key is not None:
            found = self.get(key)
            if found is not None:
                log.debug("outputs memo hit: %s (%s)", what, self.summary())
                return found
        started = time.perf_counter()
        outputs = freeze(compute())
        seconds = time.perf_counter() - started
        if key is not None:
            with self._lock:
                self.misses += 1
            kept = self.put(key, outputs, seconds)
            log.debug("outputs memo miss: %s, computed in %.2f s%s (%s)", what, seconds,
                      "" if kept else ", too big to keep", self.summary())
        return outputs

    def alias(self, key: str, other: str) -> bool:
        """Make `other` (another key for the very same computation) find `key`'s outputs. True if it did."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return False
        return self.put(other, entry[0], entry[2])  # the arrays are shared; the byte count is conservative

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def summary(self) -> str:
        return f"{self.hits} hits, {self.misses} misses, {self.saved_s:.2f} s saved, {self.bytes / 1e6:.0f} MB held"


#: The process's memo, looked up at call time (tests swap it).
MEMO = OutputsMemo()


def freeze(outputs: Outputs) -> Outputs:
    """The outputs as read-only arrays: a caller writing into one would corrupt the memo's later hits."""
    frozen = {}
    for name, value in outputs.items():
        array = np.asarray(value)
        if array.flags.writeable and not array.flags.owndata:
            array = array.copy()  # a view: the array it looks into could still be written through
        array.flags.writeable = False
        frozen[name] = array
    return frozen


def run_key(model_path: Path, batches: list[Feeds], threads: int, providers: Optional[list[str]] = None,
            session=None) -> Optional[str]:
    """The memo key of `model_path`'s outputs on `batches` under this ONNX Runtime session (or the one
    `optpipe.core.runtime.ort_session(model_path, threads, providers)` builds). None: not memoizable."""
    try:
        return session_key(model_digest(model_path), batches, threads, providers, session)
    except Exception:  # noqa: BLE001 - unreadable files, not ONNX, odd inputs: not memoized; running it says what is wrong
        log.debug("outputs memo: no key for %s", model_path, exc_info=True)
        return None


def session_key(model: str, batches: list[Feeds], threads: int, providers: Optional[list[str]] = None,
                session=None) -> str:
    return sha256_json({
        "format": KEY_FORMAT,
        "model": model,
        "inputs": batches_digest(batches),
        "session": session_signature(threads, providers, session),
    })


def session_signature(threads: int, providers: Optional[list[str]] = None, session=None) -> dict:
    """What of an ORT session can change the numbers: its providers and its options (read from
    `session` when given, else from the options `ort_session` would build)."""
    from optpipe.core.runtime import session_options

    if session is not None:
        options, providers = session.get_session_options(), session.get_providers()
    else:
        options, providers = session_options(threads), providers or ["CPUExecutionProvider"]
    return {
        "providers": list(providers),
        "intra_op_threads": options.intra_op_num_threads,
        "inter_op_threads": options.inter_op_num_threads,
        "execution_mode": str(options.execution_mode),
        "optimization": str(options.graph_optimization_level),
    }


def batches_digest(batches: list[Feeds]) -> str:
    """The inputs, exactly: per batch in order, each array's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(b"|batch")
        for name in sorted(batch):
            array = np.ascontiguousarray(batch[name])
            if array.dtype.hasobject:
                raise ValueError(f"input '{name}' holds Python objects")
            digest.update(f"|{name}|{array.dtype.str}|{array.shape}|".encode())
            digest.update(array.data)
    return digest.hexdigest()


def model_digest(path: Path) -> str:
    """The model's content: the .onnx file and every external-data file it names, by name and sha256.

    An artifact folder (model.onnx + model.onnx.data) hashes as `ModelArtifact.content_hash` does, in
    a cache entry (file hashes read from its manifest, verified on lookup) or anywhere else.
    """
    path = Path(path)
    folder = path.parent
    known = _manifest_hashes(folder)
    names = {path.name, *_external_files(path)}
    if path.name == MODEL_FILE and (folder / DATA_FILE).exists():
        names.add(DATA_FILE)  # an artifact keeps this file even when no tensor needed it
    return content_hash({name: known.get(name) or sha256_file(folder / name) for name in sorted(names)})


def _manifest_hashes(folder: Path) -> dict[str, str]:
    import json

    try:
        return dict(json.loads((folder / MANIFEST_FILE).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _external_files(path: Path) -> set[str]:
    """The external-data files the model's tensors name (graph, subgraphs, functions, attributes)."""
    import onnx

    from optpipe.safety.onnx_guard import external_locations

    return set(external_locations(onnx.load(str(path), load_external_data=False)))


def published_digest(model_path: Path, scratch: Path) -> str:
    """The content hash `model_path`'s model will have once saved as an artifact (`save_model`), which
    rewrites the file (other external-data layout, other names): saved that way into `scratch`, hashed."""
    import onnx

    from optpipe.core.artifact import save_model

    artifact = save_model(onnx.load(str(model_path)), scratch)
    return model_digest(artifact.path)
