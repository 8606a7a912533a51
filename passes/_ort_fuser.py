"""ONNX Runtime's transformer optimizer in a worker process that reads the weights from disk (issue 20;
the worker's plumbing and why it runs in the model's folder: passes/_disk_worker.py).

Why: `optimize_model` on a loaded model runs symbolic shape inference over the whole model, weights
included, several times (each copies it): on BERT-base (438 MB) it peaked at 2.76 GB. Handed the
model with its initializers left as external data, the inference copies only the graph, and the
attention fusion reads the Q/K/V weights it merges from disk: 0.45 GB, 16 s -> 2 s, the same graph
and the same weights byte for byte (measured, docs/memory.md). It writes the fused model as an artifact
in the stage's scratch folder, which the pass moves into place without reading its weights.

    python -m optpipe.passes._ort_fuser REQUEST.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import onnx

from optpipe.passes._disk_worker import DiskWorkerFailed, run_on_disk, worker_main

__all__ = ["WORKER_MIN_BYTES", "DiskWorkerFailed", "fuse_on_disk"]

#: Below this much weight data the optimizer runs in process: its copies are small, and a worker's
#: start (~0.9 s, imports) would be most of a tiny model's fuse time.
WORKER_MIN_BYTES = 64 << 20


def fuse_on_disk(model_path: Path, options: dict, scratch: Path) -> tuple[Path, dict]:
    """The fused model's file (an artifact folder's, in `scratch`: its weights are not read here) and ORT's
    fused-operator statistics, from a worker.

    `options`: optimize_model's model_type, num_heads and hidden_size."""
    out = (scratch / "fused").resolve()
    result = run_on_disk("optpipe.passes._ort_fuser", model_path, {"options": options, "out": str(out)}, scratch,
                         "ORT's fuser")
    return out / "model.onnx", result["fusions"]


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


if __name__ == "__main__":
    sys.exit(worker_main(_fuse))
