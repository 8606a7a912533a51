"""MiniLM INT8 benchmark: PyTorch eager FP32 vs ORT FP32 vs each INT8 variant, side by side in one process.

    python bench/minilm_int8.py [--recipe recipes/minilm-all.yaml] [--rounds 20] [--iterations 10]

The models are the recipe's stages (built through optpipe's cached pass manager) plus a few
variants that show what each choice buys. Every model runs batch 1 x sequence 128 on 2
pinned threads; timing rounds interleave the models so machine load hits all of them alike;
p50/p90 are over all timed runs. Accuracy: cosine per real (unpadded) token of
last_hidden_state against PyTorch eager FP32, over the recipe's evaluation sentences.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

# Variants beyond the recipe's own stages: (name, pass, parent, params).
EXTRA_STAGES = [
    ("fuse-packed", "fuse", "simplify", {"attention": "packed"}),
    ("int8-dynamic-packed", "int8", "fuse-packed", {"mode": "dynamic"}),
    ("int8-dynamic-per-tensor", "int8", "fuse", {"mode": "dynamic", "per_channel": False, "guard": False}),
    ("int8-dynamic-unfused", "int8", "simplify", {"mode": "dynamic"}),
    # ORT's three x86 integer formats on the fused graph, guard off (issue 17: what each buys per CPU class;
    # `auto` picks one of them for this CPU, passes/_int8_formats.py).
    ("int8-u8s8", "int8", "fuse", {"mode": "dynamic", "format": "u8s8", "guard": False}),
    ("int8-u8s8-reduce-range", "int8", "fuse", {"mode": "dynamic", "format": "u8s8-reduce-range", "guard": False}),
    ("int8-u8s8-reduce-range-symmetric", "int8", "fuse",
     {"mode": "dynamic", "format": "u8s8-reduce-range", "weight_symmetric": True, "guard": False}),
    ("int8-u8u8", "int8", "fuse", {"mode": "dynamic", "format": "u8u8", "guard": False}),
]


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    from optpipe.recipe.schema import StageSpec
    from optpipe.safety.recipe_loading import load_recipe

    recipe = load_recipe(args.recipe)
    for name, pass_name, parent, params in EXTRA_STAGES if not args.recipe_only else []:
        if parent in recipe.stages:
            recipe.stages[name] = StageSpec.model_validate({"pass": pass_name, "after": parent, "params": params})
    stages, services = build_stages(recipe, args.run_dir)
    samples = services.eval_set().arrays
    runners = {"pytorch-eager": eager_runner(services.torch_model(), args.threads)}
    for name, artifact in stages.items():
        if Path(artifact.path).is_file():  # not the OpenVINO stages (an IR beside it): bench/openvino_minilm.py
            runners[name] = ort_runner(artifact.path, args.threads)

    reference = outputs_of(runners["pytorch-eager"], samples, args.accuracy_batch)
    cosines = {name: token_cosine(outputs_of(run, samples, args.accuracy_batch), reference, samples["attention_mask"]) for name, run in runners.items()}
    feeds = {name: array[:1] for name, array in samples.items()}  # one real sentence, padded to 128
    load_before = os.getloadavg()
    times = time_interleaved(runners, feeds, args.threads, args.warmup, args.rounds, args.iterations)
    load_after = os.getloadavg()
    print_table(times, cosines, stages, args, load_before, load_after)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "minilm-all.yaml"))
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "bench-minilm-int8"), help="logs of the pass runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds over all models")
    parser.add_argument("--iterations", type=int, default=10, help="timed runs per model per round")
    parser.add_argument("--accuracy-batch", type=int, default=8)
    parser.add_argument("--recipe-only", action="store_true", help="only the recipe's stages, no extra variants")
    return parser.parse_args()


def build_stages(recipe, run_dir: str):
    """Every stage of the recipe through the cached pass manager (no evaluation phase)."""
    from optpipe.cache.store import StageCache, default_cache_dir
    from optpipe.plan.dag import execution_order
    from optpipe.execution.services import RunServices
    from optpipe.execution.pipeline import PassManager, RunOptions
    from optpipe.plan.validate import validate_recipe

    graph, passes = validate_recipe(recipe)
    cache = StageCache(recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir())
    services = RunServices(recipe.model_source(), recipe.data, cache)
    folder = Path(run_dir)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    from optpipe.plan.compile_plan import CompilePlan

    manager = PassManager(CompilePlan.of(recipe), cache, services, folder, RunOptions(output=folder))
    started = time.perf_counter()
    outcomes = manager.run(execution_order(graph), graph, passes)
    failed = {name: o.reason for name, o in outcomes.items() if o.status != "ok"}
    for name, reason in failed.items():
        print(f"stage {name} not measured: {reason}", file=sys.stderr)
    print(f"stages ready in {time.perf_counter() - started:.0f}s "
          f"({sum(o.cached for o in outcomes.values())} from cache)", file=sys.stderr)
    return {name: o.model for name, o in outcomes.items() if o.status == "ok"}, services


def eager_runner(torch_model, threads: int):
    import torch

    torch.set_num_threads(threads)
    module, names = torch_model.module, torch_model.input_names

    def run(feeds):
        with torch.inference_mode():
            return module(*[torch.from_numpy(feeds[n]) for n in names])[0].numpy()

    return run


def ort_runner(path: Path, threads: int):
    import onnxruntime as ort

    from optpipe.core.runtime import session_options

    options = session_options(threads)  # ORT_ENABLE_ALL, sequential, `threads` intra-op threads
    # No spin-waiting: an idle session's spinning workers took the cores from the other models in
    # this process (measured: PyTorch eager 20 ms alone, 38 ms beside one spinning session, ~480 ms
    # beside ten), and ORT itself lost nothing without it (14.5 vs 14.1 ms).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    first = session.get_outputs()[0].name

    def run(feeds):
        return session.run([first], {k: v for k, v in feeds.items() if k in inputs})[0]

    return run


def outputs_of(run, samples, batch: int) -> np.ndarray:
    count = len(samples["input_ids"])
    return np.concatenate([run({k: v[i : i + batch] for k, v in samples.items()}) for i in range(0, count, batch)])


def token_cosine(candidate: np.ndarray, reference: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """Mean and minimum cosine over real tokens (attention_mask == 1)."""
    real = mask.astype(bool)
    a, b = candidate[real].astype(np.float64), reference[real].astype(np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return float(cos.mean()), float(cos.min())


def time_interleaved(runners, feeds, threads: int, warmup: int, rounds: int, iterations: int) -> dict[str, np.ndarray]:
    """Milliseconds per run: bench/run.py's interleaved loop (rotating order, threads pinned)."""
    sys.path.insert(0, str(REPO / "bench"))
    from run import interleaved_timings

    times = interleaved_timings(runners, feeds, threads, rounds, iterations, warmup)
    return {name: np.array(t) for name, t in times.items()}


def print_table(times, cosines, stages, args, load_before, load_after) -> None:
    eager = times["pytorch-eager"]
    fp32 = times.get("fuse", times.get("export"))
    print(f"\nMiniLM-L6 (real weights), batch 1 x sequence 128, {args.threads} threads pinned, "
          f"{args.rounds} interleaved rounds x {args.iterations} runs, warm-up {args.warmup}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)\n")
    print("| model | p10 ms | p50 ms | p90 ms | vs eager p50 | vs eager p10 | vs ORT FP32 (fuse) p50 | token cosine mean | min | kept float |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, ms in times.items():
        mean, low = cosines[name]
        kept = ""
        if name in stages:
            excluded = stages[name].info.get("excluded")
            kept = str(len(excluded)) if excluded is not None else ""
        print(f"| {name} | {np.percentile(ms, 10):.2f} | {np.median(ms):.2f} | {np.percentile(ms, 90):.2f} "
              f"| {np.median(eager) / np.median(ms):.2f}x | {np.percentile(eager, 10) / np.percentile(ms, 10):.2f}x "
              f"| {np.median(fp32) / np.median(ms):.2f}x | {mean:.4f} | {low:.4f} | {kept} |")
    ok = [(np.median(eager) / np.median(times[n]), n) for n in times if n.startswith("int8") and cosines[n][0] >= 0.99]
    if ok:
        speed, name = max(ok)
        print(f"\nbest INT8 within cosine 0.99: {name}, {speed:.2f}x PyTorch eager FP32 at p50 "
              f"({np.percentile(eager, 10) / np.percentile(times[name], 10):.2f}x at p10)")


if __name__ == "__main__":
    main()
