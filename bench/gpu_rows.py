"""GPU rows for docs/benchmarks-gpu.md: ONNX Runtime's CUDA execution provider against PyTorch eager on CUDA.

    python bench/gpu_rows.py recipes/minilm-all.yaml recipes/resnet50.yaml [--dry-run]

Each recipe is cut down to its GPU candidates (export, simplify, fp16 and the static
QDQ int8 stages in TensorRT's form; no sweeps), compiled by optpipe with evaluation on
CUDA (accuracy measured there), then timed in one process, interleaved round by round:
PyTorch eager on CUDA (the baseline), every stage on ORT's CUDA EP and, only where
TensorRT's libraries load, the same stages on ORT's TensorRT EP. Timings include the
host<->device copies on both sides (ORT's run() takes and returns host arrays, so eager
does the same). `--dry-run` checks all of that without a GPU: recipes, the cut-down
stage list, the imports, and which providers would run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

# The CPU benchmark's timing loop and table writer: both documents are measured and written alike.
from run import cell, interleaved_timings, markdown_table  # noqa: E402
GPU_PASSES = {"export", "simplify", "fp16"}
EAGER = "pytorch-eager-cuda"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks-gpu.md")
    parser.add_argument("--dry-run", action="store_true", help="check recipes, stages and imports; run nothing on a GPU")
    args = parser.parse_args(argv)
    plans = [gpu_plan(path) for path in args.recipes]
    providers = gpu_providers()
    for recipe, stages in plans:
        print(f"{recipe.name}: stages {', '.join(stages)}; providers {', '.join(providers) or 'none (no CUDA device)'}")
    if args.dry_run:
        print("dry run: nothing compiled or timed")
        return 0
    if not providers:
        print("no CUDA device that ONNX Runtime can use: nothing to measure", file=sys.stderr)
        return 1
    results = [bench_gpu(recipe, providers, args) for recipe, _ in plans]
    args.output.write_text(render(results, "python bench/gpu_rows.py " + " ".join(map(str, args.recipes))))
    print(json.dumps(results, indent=1))
    print(f"written: {args.output}")
    return 0


def gpu_plan(path: Path):
    """The recipe cut down to its GPU candidates, evaluated at batch 1 only, without sweeps."""
    from optpipe.safety.recipe_loading import load_recipe
    from optpipe.plan.validate import validate_recipe

    recipe = load_recipe(path)
    keep = {name: spec for name, spec in recipe.stages.items() if _is_gpu_stage(spec)}
    # A kept stage whose parent is not (int8 after `fuse`'s com.microsoft ops) hangs off its nearest kept ancestor.
    for name, spec in list(keep.items()):
        parent = spec.after
        while parent is not None and parent not in keep:
            parent = recipe.stages[parent].after
        keep[name] = spec.model_copy(update={"after": parent})
    # A second export with nothing GPU after it (MiniLM's eager-attention export for ORT's QAttention)
    # would only repeat the first one's FP32 row: the GPU time is better spent on the candidates.
    roots = [name for name, spec in keep.items() if spec.after is None]
    parents = {spec.after for spec in keep.values()}
    keep = {name: spec for name, spec in keep.items() if name in roots[:1] or name not in roots or name in parents}
    evaluate = recipe.evaluate.model_copy(update={"sweep": {}, "batch_sizes": recipe.evaluate.batch_sizes[:1]})
    output = str(Path(recipe.resolve(recipe.output)).with_name(recipe.name + "-gpu"))
    recipe = recipe.model_copy(update={"stages": keep, "evaluate": evaluate, "output": output})
    validate_recipe(recipe)  # the cut-down DAG and every pass's params, as `optpipe validate` checks them
    return recipe, list(keep)


def _is_gpu_stage(spec) -> bool:
    if spec.pass_name in GPU_PASSES:
        return True
    params = spec.params or {}
    return spec.pass_name == "int8" and params.get("mode", "static") == "static" and params.get("target", "tensorrt") == "tensorrt"


def gpu_providers() -> list[str]:
    """CUDA EP when a device is there; TensorRT EP first only when its libraries actually load."""
    import onnxruntime as ort

    from optpipe.core.runtime import cuda_available

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available or not cuda_available():
        return []
    return (["TensorrtExecutionProvider"] if "TensorrtExecutionProvider" in available and tensorrt_loads() else []) + ["CUDAExecutionProvider"]


def tensorrt_loads() -> bool:
    import ctypes

    for name in ("libnvinfer.so.10", "libnvinfer.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def bench_gpu(recipe, providers: list[str], args) -> dict:
    import onnxruntime as ort

    from optpipe.execution.pipeline import RunOptions, compile_recipe

    started = time.perf_counter()
    report = compile_recipe(recipe, RunOptions(providers="cuda"))
    compile_s = time.perf_counter() - started
    run_dir = recipe.resolve(recipe.output)
    feeds = _feeds(recipe)
    candidates, rows = {}, []
    eager = _eager_cuda(recipe)
    if eager is not None:
        candidates[EAGER] = eager
        rows.append({"candidate": EAGER, "provider": "torch cuda", "cosine": None})
    for stage in report.stages:
        if stage.status != "ok" or stage.pass_name == "eager":
            continue
        for provider in providers:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            name = f"optpipe:{stage.name} [{provider.replace('ExecutionProvider', '')}]"
            try:
                session = ort.InferenceSession(str(run_dir / "stages" / stage.name / "model.onnx"), options,
                                               providers=[provider, "CPUExecutionProvider"])
            except Exception as exc:  # noqa: BLE001 - a provider refusing a graph is a row, not a crash
                rows.append({"candidate": name, "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            inputs = {i.name for i in session.get_inputs()}
            candidates[name] = lambda f, s=session, i=inputs: s.run(None, {k: v for k, v in f.items() if k in i})
            acc = stage.accuracy
            rows.append({"candidate": name, "provider": provider, "cosine": acc.worst_cosine if acc else None,
                         "nodes_on_provider": _placement(session)})
    # All the host's cores (pinned to what it has): the GPU does the work, the host only feeds it.
    timings = interleaved_timings(candidates, feeds, len(os.sched_getaffinity(0)), args.rounds, args.iterations, args.warmup)
    eager_p50 = float(np.median(timings[EAGER])) if EAGER in timings else None
    for row in rows:
        times = timings.get(row["candidate"])
        if times:
            row["p50_ms"] = float(np.median(times))
            row["p90_ms"] = float(np.percentile(times, 90))
            row["speedup_vs_eager"] = eager_p50 / row["p50_ms"] if eager_p50 else None
    return {"model": recipe.name, "shapes": {k: list(v.shape) for k, v in feeds.items()}, "compile_s": round(compile_s, 1),
            "device": _device_name(), "rows": rows}


def _placement(session) -> str | None:
    """Which providers the session kept (ORT falls back to CPU silently for unsupported nodes)."""
    return ", ".join(p.replace("ExecutionProvider", "") for p in session.get_providers())


def _feeds(recipe) -> dict[str, np.ndarray]:
    from optpipe.cache.store import StageCache, default_cache_dir
    from optpipe.calibration.dataset import build_sample_set

    cache = StageCache(recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir())
    return build_sample_set(recipe.data.eval, recipe.model_source(), cache.root).first(recipe.evaluate.batch_sizes[0])


def _eager_cuda(recipe):
    import torch

    from optpipe.source.model_source import load_torch_model

    if not torch.cuda.is_available():
        return None
    model = load_torch_model(recipe.model_source())
    module = model.module.cuda().eval()

    def run(feeds):
        with torch.inference_mode():
            outs = module(*[torch.from_numpy(np.ascontiguousarray(feeds[n])).cuda() for n in model.input_names])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return [o.cpu().numpy() for o in outs if hasattr(o, "cpu")]  # .cpu() synchronises, as ORT's run() does

    return run


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def render(results: list[dict], command: str) -> str:
    lines = ["# GPU benchmarks", "", f"Produced by `{command}` (scripts/gpu_checks.sh) on {datetime.now(timezone.utc).date()}, "
             f"{os.cpu_count()} host cores. PyTorch eager on CUDA is the baseline; ORT rows run on the named execution provider; "
             "all timings include host<->device copies; interleaved rounds, p50 over all timed runs. Cosine: what optpipe "
             "measured on CUDA against the reference stage.", ""]
    for r in results:
        lines += [f"### {r['model']} on {r['device']}", "", f"inputs {r['shapes']}, compile {r['compile_s']} s", ""]
        lines += markdown_table(
            ["candidate", "p50 ms", "p90 ms", "vs eager CUDA", "cosine", "providers kept"],
            [[row["candidate"], f"not run: {row['error']}", "", "", "", ""] if "error" in row else
             [row["candidate"], cell(row.get("p50_ms"), ".3f"), cell(row.get("p90_ms"), ".3f"), cell(row.get("speedup_vs_eager"), ".2f", "x"),
              cell(row.get("cosine"), ".5f"), row.get("nodes_on_provider") or ""] for row in r["rows"]])
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
