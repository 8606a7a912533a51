"""weight_only's quantization in a worker process that reads the weights from disk (issue 20; the worker's
plumbing and why it runs in the model's folder: passes/_disk_worker.py).

Why: ORT's MatMulNBitsQuantizer on a loaded model holds every float weight beside the quantized ones, and
saving the result copies what is left once more: on Gemma 3 270M (1.07 GB of weights) the pass peaked at
3.4 GB. Handed the graph with its large initializers left as external data, the quantizer reads each weight
from disk when it quantizes it (onnx_ir maps it, onnx loads it on demand), the tied head is quantized from
the table's rows a slice at a time (passes/_tied_head_nbits.py), and the weights left in float (the embedding
table) are copied from file to file. The same functions run in process on small models: the
worker differs only in where the weights are while they are quantized (tests compare the two models).

    python -m optpipe.passes._weight_only_on_disk REQUEST.json
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

from optpipe.passes._disk_worker import (SHAPE_TENSOR_BYTES, DiskWorkerFailed, graph_with_small_tensors, run_on_disk,
                                        save_reading_from, worker_main)
from optpipe.passes._nbits_quantize import quantize_weights

__all__ = ["SHAPE_TENSOR_BYTES", "WORKER_MIN_BYTES", "DiskWorkerFailed", "quantize_on_disk"]

#: From this much weight data the quantizer runs in the worker (onnxslim's bound, passes/_onnxslim_on_disk.py):
#: below it the copies are small and a worker's start and imports would be much of the pass's time.
WORKER_MIN_BYTES = 256 << 20


def quantize_on_disk(model_path: Path, params: dict, out: Path, scratch: Path) -> dict:
    """The quantized model written as an artifact in `out`, from a worker; what was done (quantize_weights' facts)."""
    request = {"params": params, "out": str(out.resolve()), "small_bytes": SHAPE_TENSOR_BYTES}
    return run_on_disk("optpipe.passes._weight_only_on_disk", model_path, request, scratch, "the weight-only quantizer's")


def _quantize(request: dict) -> dict:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    source = Path(request["model"])
    model = graph_with_small_tensors(source, request["small_bytes"])  # the weights stay on disk (cwd: their folder) until read
    params = SimpleNamespace(**request["params"])  # the pass's WeightOnlyParams, validated there
    quantized, facts = quantize_weights(model, params, logging.getLogger("optpipe.passes.weight_only"), source.parent)
    del model
    save_reading_from(quantized, Path(request["out"]), source.parent)  # those left in float: file to file
    return facts


if __name__ == "__main__":
    sys.exit(worker_main(_quantize))
