"""weight_only's `algorithm: awq`: NNCF's activation-aware INT4 weight compression on the ONNX graph, for ONNX Runtime.

Why NNCF on ONNX: ONNX Runtime 1.31's own data-aware path (MatMulNBitsQuantizer's GPTQ, through the Intel Neural
Compressor code it ships) returns round-to-nearest (docs/llm.md, bench/ort_gptq.py), so ORT alone had no INT4 that
uses calibration data. NNCF's ONNX backend runs AWQ (and optionally scale estimation) with its statistics taken by
ONNX Runtime, and writes `com.microsoft.MatMulNBits`: the form and kernels of the default algorithm.

What it writes, and why symmetric only:
- `ratio` of the MatMuls in INT4 (NNCF ranks them by their activations' sensitivity), symmetric blocks of
  `block_size`. NNCF 3.4's asymmetric INT4 zero points are written unpacked ([N, blocks]), which ORT 1.31 refuses to
  load ("zero_points initializer shape {64,2} does not match"); measured, so `symmetric: false` is a recipe error.
- Everything NNCF leaves in float (its backup is turned off: it would write DequantizeLinear + a float MatMul,
  which dequantizes on every call) goes through the default algorithm at 8 bits: the other `1 - ratio` of the
  MatMuls and the LM head (tied or not), as NNCF's own INT8 backup does for OpenVINO.
- NNCF's MatMulNBits carry accuracy_level 0; they are given the stage's (4: int8 activations, ORT CPU's fast path).

Memory: NNCF reads the weights from the artifact's folder (its ONNX backend's EXTERNAL_DATA_DIR) rather than a
loaded model: Gemma 3 270M (1.07 GB), the call's process peaked at 2.45 GB against 8.5 GB on the loaded model.
It runs in the disk worker of passes/_disk_worker.py (the working directory there is the weights' folder), which
gives back what NNCF and its statistics sessions held when it exits.

    python -m optpipe.passes._nncf_awq REQUEST.json
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import onnx

from optpipe.passes._calibration_feeds import calibration_feeds
from optpipe.passes._disk_worker import SHAPE_TENSOR_BYTES, graph_with_small_tensors, run_on_disk, save_reading_from, worker_main
from optpipe.passes._nbits_quantize import check_names, quantize_weights, set_accuracy_level

if TYPE_CHECKING:
    from optpipe.pass_infra.pass_base import PassContext

CALIBRATION_FILE = "calibration.npz"
LOG = "optpipe.passes.weight_only"


def awq_on_disk(model_path: Path, params: dict, ctx: "PassContext", scratch: Path) -> dict:
    """The compressed model written as an artifact in ctx.workdir, from a worker; what was done."""
    feeds = onnx_calibration_feeds(ctx, model_path)
    scratch.mkdir(parents=True, exist_ok=True)
    arrays = {f"{i}/{name}": value for i, batch in enumerate(feeds) for name, value in batch.items()}
    np.savez(scratch / CALIBRATION_FILE, **arrays)
    request = {"params": params, "out": str(ctx.workdir.resolve()), "small_bytes": SHAPE_TENSOR_BYTES,
               "calibration": str((scratch / CALIBRATION_FILE).resolve()), "samples": len(feeds)}
    return run_on_disk("optpipe.passes._nncf_awq", model_path, request, scratch, "NNCF's AWQ")


def onnx_calibration_feeds(ctx: "PassContext", model_path: Path) -> list[dict[str, np.ndarray]]:
    """data.calibration in the batches the ONNX graph takes (passes/_calibration_feeds.py)."""
    from optpipe.evaluation.generation_inputs import graph_inputs

    return calibration_feeds(ctx, list(graph_inputs(model_path).items()))


def compress(model: onnx.ModelProto, params, folder: Path, feeds: list[dict[str, np.ndarray]], log: logging.Logger):
    """`model` (large weights still on disk in `folder`) with `ratio` of its MatMuls in INT4 by NNCF's AWQ and the
    rest at 8 bits; what was done."""
    from optpipe.evaluation.openvino_runtime import nncf as import_nncf, telemetry_off

    nncf = import_nncf()
    from nncf.onnx.quantization.backend_parameters import BackendParameters

    options = dict(mode=nncf.CompressWeightsMode.INT4_SYM, group_size=params.block_size, ratio=params.ratio,
                   backup_mode=nncf.BackupMode.NONE, awq=True, scale_estimation=params.scale_estimation,
                   dataset=nncf.Dataset(feeds), subset_size=len(feeds),
                   advanced_parameters=nncf.AdvancedCompressionParameters(
                       backend_params={BackendParameters.EXTERNAL_DATA_DIR: str(folder.resolve())}))
    if params.exclude:
        check_names(model, params.exclude)  # before NNCF's statistics, and whether or not anything is left for 8 bits
        options["ignored_scope"] = nncf.IgnoredScope(names=list(params.exclude), validate=False)
    with telemetry_off():
        model = nncf.compress_weights(model, **options)
    int4 = [node for node in model.graph.node if node.op_type == "MatMulNBits"]
    set_accuracy_level(model, params.accuracy_level)  # NNCF writes 0
    log.info("NNCF AWQ: %d MatMuls in INT4", len(int4))
    facts = {"int4_matmuls": len(int4), "int8_matmuls": 0}
    backup = SimpleNamespace(**{**vars(params), "bits": 8, "symmetric": True, "algorithm": "default", "gather": False})
    model, rest = quantize_weights(model, backup, log, folder, required=False)  # the leftovers, where there are any
    facts.update(int8_matmuls=rest["candidates"], transposed_weights=rest["transposed_weights"],
                 left_in_float=rest["left_in_float"])
    return model, facts


def _awq(request: dict) -> dict:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    source = Path(request["model"])
    stored = np.load(request["calibration"])
    feeds = [{key.split("/", 1)[1]: stored[key] for key in stored.files if key.startswith(f"{i}/")}
             for i in range(request["samples"])]
    model = graph_with_small_tensors(source, request["small_bytes"])  # the weights stay on disk (cwd: their folder)
    params = SimpleNamespace(**request["params"])  # the pass's WeightOnlyParams, validated there
    compressed, facts = compress(model, params, source.parent, feeds, logging.getLogger(LOG))
    del model
    save_reading_from(compressed, Path(request["out"]), source.parent)
    return facts


if __name__ == "__main__":
    sys.exit(worker_main(_awq))
