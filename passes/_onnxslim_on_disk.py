"""onnxslim in a worker process that reads the large weights from disk (issue 20; the worker's plumbing
and why it runs in the model's folder: passes/_disk_worker.py).

Why: `onnxslim.slim` on a loaded model holds the input, a graphsurgeon checkpoint of every iteration's
model and each iteration's export: on Gemma 3 270M (1.08 GB of weights) it peaked at 4.6 GB alone, 6.3 GB
in a compile. Handed the graph with only its tensors under `SHAPE_TENSOR_BYTES` loaded (shape constants,
biases, norms: what its patterns read), the weight matrices stay external data that its graphsurgeon
passes through untouched (LazyValues export their TensorProto as it came) or reads from disk where a
fold needs one: 1.7 GB peak, the graph node for node the same (measured; docs/memory.md). The weights it
passed through are then copied from file to file, not loaded to be saved (passes/_disk_worker.save_reading_from):
on Gemma's simplify the worker's tree went from ~2.1 GB to 0.5 GB. The shapes are
inferred on that same graph first, as the in-memory path does (passes/simplify.py).

Small tensors are loaded, not left on disk, because onnxslim's bundled graphsurgeon exports a constant
it has read as raw data that still says "external" (it copies `data_location`); onnx then refuses it in
the next iteration. A weight it reads that is over the bound fails the worker the same way, and the
pass falls back to the in-memory path.

    python -m optpipe.passes._onnxslim_on_disk REQUEST.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import onnx

from optpipe.passes._disk_worker import (SHAPE_TENSOR_BYTES, DiskWorkerFailed, graph_with_small_tensors, run_on_disk,
                                        save_reading_from, worker_main)

__all__ = ["WORKER_MIN_BYTES", "DiskWorkerFailed", "SHAPE_TENSOR_BYTES", "graph_with_small_tensors", "infer_shapes_into", "slim_on_disk"]

#: From this much weight data onnxslim runs in the worker. Not the fuser's 64 MB: on MiniLM (90 MB) onnxslim
#: in process took 2.4-2.7 s and the worker 4.2-5.0 s (its start and imports; the output byte for byte the
#: same), two seconds of the default compile for 0.2 GB; BERT-base (438 MB) and larger are worth it.
WORKER_MIN_BYTES = 256 << 20

def slim_on_disk(model_path: Path, out: Path, scratch: Path) -> dict:
    """onnxslim's result written as an artifact in `out` (weights loaded), from a worker; how its shapes were inferred."""
    request = {"out": str(out.resolve()), "small_bytes": SHAPE_TENSOR_BYTES}
    return run_on_disk("optpipe.passes._onnxslim_on_disk", model_path, request, scratch, "onnxslim's")


def infer_shapes_into(target: onnx.ModelProto, graph: onnx.ModelProto) -> str | None:
    """ORT's symbolic shape inference, with onnxslim's own settings, on `graph`; its value_info replaces
    `target`'s. None when done, else why it could not infer `graph` (then onnxslim infers the shapes itself)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    from onnxslim.core import AUTO_MERGE  # the setting onnxslim's own inference runs with

    try:
        inferred = SymbolicShapeInference.infer_shapes(graph, auto_merge=AUTO_MERGE)
    except Exception as exc:  # noqa: BLE001 - it read a weight held out, or cannot infer this graph
        return str(exc) or type(exc).__name__
    del target.graph.value_info[:]
    target.graph.value_info.extend(inferred.graph.value_info)
    return None


def _slim(request: dict) -> dict:
    import onnxslim

    source = Path(request["model"])
    model = graph_with_small_tensors(source, request["small_bytes"])
    failed = infer_shapes_into(model, model)  # reads a held-out weight from disk where it needs one (cwd: its folder)
    if failed:
        print(f"graph-only shape inference failed ({failed}); onnxslim infers the shapes", file=sys.stderr)
    shapes = "onnxslim" if failed else "graph-only"
    slimmed = onnxslim.slim(model, verbose=True, no_shape_infer=shapes == "graph-only")
    del model
    save_reading_from(slimmed, Path(request["out"]), source.parent)  # the weights it passed through: file to file
    return {"shape_inference": shapes}


if __name__ == "__main__":
    sys.exit(worker_main(_slim))
