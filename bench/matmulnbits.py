"""MatMulNBits settings side by side, at the decode shapes of a Llama-style decoder (issue 20, item 2).

One graph per weight shape: x[M, K] @ W[K, N] with W random, quantized by the weight_only pass's own
quantizer call (passes/_nbits_quantize.quantize) for every setting, then every setting is timed in one
process, interleaved in rounds (median of rounds), at M = 1, 4 and 16 rows (a decode step at batch M).

    python bench/matmulnbits.py [--shapes 2048x2048,2048x5632,5632x2048] [--threads 1] [--rounds 7]

Prints, per M, each setting's time for the whole layer set (the sum over the shapes, as one decoder
layer's projections) and its ratio to FP32 and to INT8 level 4.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SETTINGS = {  # label: weight_only params (None: the FP32 MatMul)
    "fp32": None,
    "int8 b32 l4": dict(bits=8, block_size=32, accuracy_level=4),
    "int8 b128 l4": dict(bits=8, block_size=128, accuracy_level=4),
    "int8 b32 l0": dict(bits=8, block_size=32, accuracy_level=0),
    "int4 b32 l4": dict(bits=4, block_size=32, accuracy_level=4),
    "int4 b64 l4": dict(bits=4, block_size=64, accuracy_level=4),
    "int4 b128 l4": dict(bits=4, block_size=128, accuracy_level=4),
    "int4 b32 l0": dict(bits=4, block_size=32, accuracy_level=0),
    "int4 b128 l0": dict(bits=4, block_size=128, accuracy_level=0),
    "int4 b32 l4 asym": dict(bits=4, block_size=32, accuracy_level=4, symmetric=False),
}


def matmul_model(k: int, n: int, seed: int) -> onnx.ModelProto:
    weight = np.random.default_rng(seed).standard_normal((k, n), dtype=np.float32) * 0.02
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def sessions(shapes, threads: int, folder: Path):
    import onnxruntime as ort

    from optpipe.passes._nbits_quantize import quantize
    from optpipe.passes.weight_only import WeightOnlyParams

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    made = {}
    for label, params in SETTINGS.items():
        made[label] = []
        for i, (k, n) in enumerate(shapes):
            model = matmul_model(k, n, i)
            if params is not None:
                model = quantize(model, WeightOnlyParams(**params), logging.getLogger("bench"))[0]
            path = folder / f"{label.replace(' ', '_')}-{k}x{n}.onnx"
            onnx.save(model, str(path))
            made[label].append((ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), k))
    return made


def time_once(runs, m: int, repeats: int) -> float:
    total = 0.0
    for session, k in runs:
        x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
        session.run(None, {"x": x})  # warm
        started = time.perf_counter()
        for _ in range(repeats):
            session.run(None, {"x": x})
        total += (time.perf_counter() - started) / repeats
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="2048x2048,2048x5632,5632x2048", help="KxN of the layer's weights")
    parser.add_argument("--ms", default="1,4,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        made = sessions(shapes, args.threads, Path(tmp))
        flags = set(open("/proc/cpuinfo").read().split())
        cpu = "AMX + AVX-512 VNNI" if "amx_tile" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags else \
            "AVX-VNNI + AVX2" if "avx_vnni" in flags else "AVX2"
        print(f"shapes {args.shapes}, threads {args.threads}, CPU {cpu}, load {open('/proc/loadavg').read().split()[0]}")
        for m in [int(v) for v in args.ms.split(",")]:
            times = {label: [] for label in made}
            for _ in range(args.rounds):
                for label, runs in made.items():  # interleaved: every setting once per round
                    times[label].append(time_once(runs, m, args.repeats))
            medians = {label: statistics.median(v) for label, v in times.items()}
            base, int8 = medians["fp32"], medians["int8 b32 l4"]
            print(f"\nM = {m}  (load {open('/proc/loadavg').read().split()[0]})")
            print(f"| setting | us per layer set | vs fp32 | vs int8 b32 l4 | p90/p50 |")
            print("|---|---|---|---|---|")
            for label, value in medians.items():
                spread = sorted(times[label])[int(0.9 * (len(times[label]) - 1))] / value
                print(f"| {label} | {value * 1e6:.0f} | {base / value:.2f}x | {int8 / value:.2f}x | {spread:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
