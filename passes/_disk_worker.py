"""A library call on a model whose weights stay on disk, in a short-lived worker process (issue 20).

Why a worker: libraries that take a loaded ModelProto copy it, weights included, several times (ORT's
transformer optimizer through its shape inference, onnxslim once per iteration and in its checkpoint).
Handed the model with its large initializers left as external data (dims kept, bytes on disk), they copy
only the graph, and read the few weights they need through onnx's `numpy_helper.to_array`, which loads
a tensor's external data on demand. They call it without a base folder, so onnx resolves each location
against the working directory. Changing the compile's own working directory would move it under every
other thread, so the call runs in a worker whose working directory is the input artifact's folder (read
only; onnx refuses absolute locations and `..`, so a location cannot leave that folder) and whose
temporary files go to the stage's own scratch folder.

Parent side: `run_on_disk(module, model_path, request, scratch, what)`. Worker side, at the end of the
worker module: `sys.exit(worker_main(function))`, where `function(request) -> dict` is the JSON result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

import onnx
from onnx import external_data_helper

from optpipe.core.errors import PassError

#: Initializers up to this size are loaded with the graph: shape constants, biases, norms (what graph passes read).
SHAPE_TENSOR_BYTES = 1 << 20


class DiskWorkerFailed(RuntimeError):
    """The worker's library call raised or the worker died; the message is its one line (type, where, what).
    `said`: where the worker raised a PassError, that line as the pass worded it, to be shown as it is."""

    def __init__(self, message: str, said: str | None = None):
        super().__init__(message)
        self.said = said


def run_on_disk(module: str, model_path: Path, request: dict, scratch: Path, what: str) -> dict:
    """Run `python -m module` on `request` (with "model": the input's path, "result": where the worker
    writes its JSON) in `model_path`'s folder; its result. `what` names the worker in a death message."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "tmp").mkdir(exist_ok=True)
    request = {**request, "model": str(model_path.resolve()), "result": str((scratch / "result.json").resolve())}
    (scratch / "request.json").write_text(json.dumps(request))
    env = {**os.environ, "TMPDIR": str((scratch / "tmp").resolve())}
    with open(scratch / "worker.log", "w", encoding="utf-8") as log:
        worker = subprocess.Popen([sys.executable, "-m", module, str((scratch / "request.json").resolve())],
                                  cwd=str(model_path.parent), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            returncode = worker.wait()
        except BaseException:  # Ctrl-C, the stage's time limit: the worker must not outlive the stage
            worker.kill()
            worker.wait()
            raise
    result_path = Path(request["result"])
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if returncode != 0 or "error" in result:
        raise DiskWorkerFailed(result.get("error") or _death(what, returncode, scratch / "worker.log"), result.get("said"))
    return result


def _death(what: str, returncode: int, log: Path) -> str:
    last = next((line for line in reversed(log.read_text(errors="replace").splitlines()) if line.strip()), "")
    killed = f"killed by signal {-returncode}" + (" (out of memory?)" if returncode == -9 else "") if returncode < 0 else f"exit {returncode}"
    return f"{what} worker died ({killed}){': ' + last[:200] if last else ''}"


def worker_main(function: Callable[[dict], dict]) -> int:
    """The worker's body: the request from argv, `function`'s result (or its failure, one line) to the result file."""
    request = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = function(request)
    except Exception as exc:  # the parent reports it as the library's failure, one line
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" in {Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else ""
        message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        result = {"error": f"{type(exc).__name__}{where}: {message}"}
        if isinstance(exc, PassError):  # the pass's own line for the user, whole
            result["said"] = str(exc)
        traceback.print_exc()
    Path(request["result"]).write_text(json.dumps(result))
    return 0


def graph_with_small_tensors(path: Path, small_bytes: int = SHAPE_TENSOR_BYTES) -> onnx.ModelProto:
    """The model with only its initializers under `small_bytes` loaded (marked internal); the rest keep
    their external-data entries (dims kept, bytes on disk)."""
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        if external_data_helper.uses_external_data(tensor) and _length(tensor) < small_bytes:
            external_data_helper.load_external_data_for_tensor(tensor, str(path.parent))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return model


def _length(tensor: onnx.TensorProto) -> int:
    return int(next((e.value for e in tensor.external_data if e.key == "length"), 0) or 0)


def save_reading_from(model: onnx.ModelProto, out: Path, folder: Path) -> None:
    """`model` written as an artifact in `out`: its loaded tensors as save_model writes them, and those still
    external data in `folder` copied from file to file a slice at a time, never loaded. Loading them to save
    them held each in memory twice (its proto's bytes and the copy onnx's writer reads): on Gemma 3 270M the
    weight_only worker's peak was the 0.67 GB embedding table, twice."""
    from optpipe.core.artifact import DATA_FILE, MODEL_FILE, save_model
    from optpipe.safety.onnx_guard import external_bytes

    pending = []
    for tensor in external_data_helper._get_all_tensors(model):
        if external_data_helper.uses_external_data(tensor) and tensor.HasField("raw_data"):
            tensor.data_location = onnx.TensorProto.DEFAULT  # read by a library that kept the mark: in memory
            del tensor.external_data[:]
        elif external_data_helper.uses_external_data(tensor):
            pending.append((tensor, *external_bytes(tensor, folder)))
    save_model(model, out)  # onnx writes the loaded tensors and passes over the ones without bytes
    with open(out / DATA_FILE, "ab") as target:
        for tensor, path, offset, length in pending:
            start = target.tell()
            with open(path, "rb") as source:
                source.seek(offset)
                _copy_bytes(source, target, length)
            del tensor.external_data[:]
            for key, value in (("location", DATA_FILE), ("offset", str(start)), ("length", str(target.tell() - start))):
                tensor.external_data.add(key=key, value=value)
    onnx.save_model(model, str(out / MODEL_FILE))  # the graph again, with the copied tensors' places


def _copy_bytes(source, target, length: int, step: int = 16 << 20) -> None:
    while length > 0:
        chunk = source.read(min(step, length))
        if not chunk:
            raise ValueError("an external data file is shorter than its tensors say")
        target.write(chunk)
        length -= len(chunk)
