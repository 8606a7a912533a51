"""ONNX Runtime's transformer optimizer in a worker process that reads the weights from disk (issue 20).

Why: `optimize_model` on a loaded model runs symbolic shape inference over the whole model, weights
included, several times (each copies it): on BERT-base (438 MB) it peaked at 2.76 GB. Handed the
model with its initializers left as external data (dims kept, bytes on disk), the inference copies
only the graph, and the attention fusion reads the Q/K/V weights it merges through onnx's
`numpy_helper.to_array`, which loads a tensor's external data on demand: 0.45 GB, 16 s -> 2 s, the
same graph and the same weights byte for byte (measured, docs/memory.md).

ORT calls `to_array` without a base folder, so onnx resolves each location against the working
directory. Changing the compile's own working directory would move it under every other thread, so
the optimizer runs in a short-lived worker whose working directory is the input artifact's folder
(read only; onnx refuses absolute locations and `..`, so a location cannot leave that folder) and
whose temporary files go to the stage's own scratch folder. It writes the fused model, weights
loaded, as an artifact in that scratch folder.

    python -m optpipe.passes._ort_fuser REQUEST.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import onnx

#: Below this much weight data the optimizer runs in process: its copies are small, and a worker's
#: start (~0.9 s, imports) would be most of a tiny model's fuse time.
WORKER_MIN_BYTES = 64 << 20


class FuserWorkerFailed(RuntimeError):
    """The worker's optimizer raised or died; the message is its one line (type, where, what)."""


def fuse_on_disk(model_path: Path, options: dict, scratch: Path) -> tuple[onnx.ModelProto, dict]:
    """The fused model (weights in memory) and ORT's fused-operator statistics, from a worker.

    `options`: optimize_model's model_type, num_heads and hidden_size."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "tmp").mkdir(exist_ok=True)
    request = {"model": str(model_path.resolve()), "options": options,
               "out": str((scratch / "fused").resolve()), "result": str((scratch / "result.json").resolve())}
    (scratch / "request.json").write_text(json.dumps(request))
    env = {**os.environ, "TMPDIR": str((scratch / "tmp").resolve())}
    with open(scratch / "worker.log", "w", encoding="utf-8") as log:
        worker = subprocess.Popen([sys.executable, "-m", "optpipe.passes._ort_fuser", str((scratch / "request.json").resolve())],
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
        raise FuserWorkerFailed(result.get("error") or _death(returncode, scratch / "worker.log"))
    fused = onnx.load(str(Path(request["out"]) / "model.onnx"))
    return fused, result["fusions"]


def _death(returncode: int, log: Path) -> str:
    last = next((line for line in reversed(log.read_text(errors="replace").splitlines()) if line.strip()), "")
    killed = f"killed by signal {-returncode}" + (" (out of memory?)" if returncode == -9 else "") if returncode < 0 else f"exit {returncode}"
    return f"ORT's fuser worker died ({killed}){': ' + last[:200] if last else ''}"


def _fuse(request: dict) -> dict:
    from onnxruntime.transformers.optimizer import optimize_model

    from optpipe.core.artifact import save_model

    source = Path(request["model"])
    # Weights left on disk: dims kept, bytes read by to_array where a fusion needs them (cwd = source's folder).
    model = onnx.load(str(source), load_external_data=False)
    optimized = optimize_model(model, opt_level=0, use_gpu=False, **request["options"])  # the Python fusions only
    stats = optimized.get_fused_operator_statistics() or {}
    fused = optimized.model
    onnx.external_data_helper.load_external_data_for_model(fused, str(source.parent))
    save_model(fused, Path(request["out"]))  # optpipe's save: onnx's own checks `location` against the cwd
    return {"fusions": {name: n for name, n in stats.items() if n}}


def main(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    try:
        result = _fuse(request)
    except Exception as exc:  # the parent reports it as the fuser's failure, one line
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" in {Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else ""
        message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        result = {"error": f"{type(exc).__name__}{where}: {message}"}
        traceback.print_exc()
    Path(request["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
