"""Build an ONNX model over 2 GB (one 2.2 GB Gather table in external data) and compile it:
import, simplify (onnxslim), evaluation, run folder. Prints the wall time and peak memory.

    python bench/large_model.py /tmp/big        # needs ~12 GB of disk and ~9 GB of memory

Measured (shared 2-core VM): 34-39 s cold, 22-23 s cached, peak RSS 8.8 GB; `cache verify` clean.
"""
from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROWS, DIM = 540_000, 1024  # 2.21 GB of float32: over onnx.checker.MAXIMUM_PROTOBUF

RECIPE = """\
name: big
model: {onnx: model/model.onnx}
inputs:
  - {name: ids, dtype: int64, shape: [batch, 4], range: [0, %d]}
dims:
  batch: {min: 1, opt: 1, max: 2}
data:
  eval: {source: synthetic, samples: 4}
stages:
  export: {pass: export}
  simplify: {pass: simplify, after: export}
evaluate: {warmup: 1, iterations: 3, batch_sizes: [1], eager_baseline: false, accuracy_batch: 2}
output: run
cache: cache
""" % ROWS


def write_model(folder: Path) -> None:
    """Written in chunks through a memmap, and referenced by hand: never 2 GB in one protobuf."""
    folder.mkdir(parents=True, exist_ok=True)
    table = np.memmap(folder / "model.onnx.data", dtype=np.float32, mode="w+", shape=(ROWS, DIM))
    for start in range(0, ROWS, 20_000):
        rows = np.arange(start, min(ROWS, start + 20_000), dtype=np.float32)[:, None]
        table[start : start + len(rows)] = (rows % 97) * 0.01 + np.arange(DIM, dtype=np.float32) * 1e-4
    table.flush()
    del table
    tensor = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[ROWS, DIM], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "model.onnx.data"), ("offset", "0"), ("length", str(ROWS * DIM * 4))):
        tensor.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)], "big",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, DIM])], [tensor],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save_model(model, str(folder / "model.onnx"))


def main(folder: Path) -> int:
    write_model(folder / "model")
    (folder / "big.yaml").write_text(RECIPE)
    for label in ("cold", "cached"):
        started = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "optpipe.cli", "compile", "big.yaml"], cwd=folder)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
        print(f"{label}: exit {code}, {time.perf_counter() - started:.1f} s, peak RSS so far {peak:.1f} GB")
        if code:
            return code
    return subprocess.call([sys.executable, "-m", "optpipe.cli", "cache", "--cache-dir", "cache", "verify", "--run", "run"], cwd=folder)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/optpipe-large-model")))
