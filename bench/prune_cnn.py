"""Structured pruning vs dense on a CNN, measured side by side in one process.

    python bench/prune_cnn.py [--batch 1] [--threads 2] [--iterations 40] [--amount 0.5]

Exports ResNet-50 (optpipe/models/resnet.py, seeded random weights) with the dynamo exporter,
simplifies it with onnxslim (as the `simplify` stage does), then makes the candidates with
the prune pass's own functions: structured at `amount` (all sound channel groups, and
residual streams left whole), 80% magnitude zeros and 2:4 zeros. Every model runs in
ONNX Runtime (CPU, `--threads` intra-op threads, process pinned to that many cores);
iterations are interleaved round-robin after warm-up so drift hits all models alike.
Prints median / p90 latency and the speed-up against dense.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx


def export_resnet50(folder: Path) -> onnx.ModelProto:
    import onnxslim
    import torch

    from optpipe.models.resnet import resnet50

    x = torch.randn(1, 3, 224, 224)
    program = torch.onnx.export(
        resnet50(), (x,), dynamo=True, opset_version=20, input_names=["images"], output_names=["logits"],
        dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=32)},),
    )
    program.save(str(folder / "raw.onnx"), external_data=True)
    return onnxslim.slim(onnx.load(str(folder / "raw.onnx")))


def candidates(dense: onnx.ModelProto, amount: float) -> dict[str, tuple[onnx.ModelProto, str]]:
    from optpipe.graph.edit import name_unnamed_nodes
    from optpipe.passes.prune import PruneParams, prune_structured, sparsify_weights

    def copy():
        model = onnx.ModelProto()
        model.CopyFrom(dense)
        return name_unnamed_nodes(model)

    made = {"dense": (copy(), "")}
    for label, params in {
        f"structured {amount:.0%}": PruneParams(amount=amount),
        f"structured {amount:.0%}, residual kept": PruneParams(amount=amount, residual_streams=False),
        "magnitude 80% (zeros)": PruneParams(method="magnitude", amount=0.8),
        "2:4 (zeros)": PruneParams(method="2:4"),
    }.items():
        model = copy()
        details = prune_structured(model, params) if params.method == "structured" else sparsify_weights(model, params)
        note = (
            f"{details['channels_removed']}/{details['channels_in_pruned_groups']} channels removed"
            if params.method == "structured"
            else f"sparsity {details['sparsity']:.0%}"
        )
        made[label] = (model, note)
    return made


def measure(models: dict, batch: int, threads: int, warmup: int, iterations: int) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    from optpipe.core.runtime import pinned_threads, session_options

    x = np.random.default_rng(0).normal(size=(batch, 3, 224, 224)).astype(np.float32)
    sessions = {
        label: ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])
        for label, (model, _) in models.items()
    }
    times = {label: [] for label in sessions}
    with pinned_threads(threads):
        for _ in range(warmup):
            for session in sessions.values():
                session.run(None, {"images": x})
        for _ in range(iterations):
            for label, session in sessions.items():
                start = time.perf_counter()
                session.run(None, {"images": x})
                times[label].append((time.perf_counter() - start) * 1e3)
    return {label: np.asarray(t) for label, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--amount", type=float, default=0.5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dense = export_resnet50(Path(tmp))
    models = candidates(dense, args.amount)
    times = measure(models, args.batch, args.threads, args.warmup, args.iterations)
    base = np.median(times["dense"])
    params = {label: sum(int(np.prod(i.dims)) for i in model.graph.initializer) for label, (model, _) in models.items()}
    print(f"ResNet-50 (random weights), batch {args.batch}, {args.threads} threads, "
          f"{args.iterations} interleaved iterations after {args.warmup} warm-up, ONNX Runtime CPU")
    print(f"| model | median ms | p90 ms | speed-up vs dense | parameters | what |")
    print("|---|---|---|---|---|---|")
    for label, t in times.items():
        median = np.median(t)
        print(f"| {label} | {median:.2f} | {np.percentile(t, 90):.2f} | {base / median:.2f}x | "
              f"{params[label] / 1e6:.1f} M | {models[label][1]} |")


if __name__ == "__main__":
    main()
