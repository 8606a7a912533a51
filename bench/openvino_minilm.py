"""MiniLM on OpenVINO: PyTorch eager FP32 vs ORT FP32 vs each OpenVINO variant, side by side in one process.

    python bench/openvino_minilm.py [--recipe recipes/minilm.yaml] [--batch 1,8] [--calibration-samples 64] [--rounds 10]

Every variant is an `openvino` stage hung after the recipe's `simplify` (built and cached by
optpipe's pass manager). Accuracy is the cosine per real token of last_hidden_state against
PyTorch eager FP32 over the recipe's evaluation sentences (mean, and the worst sentence's
mean); timing interleaves the models round by round on pinned threads (see bench/minilm_int8.py).
What each variant bought goes to docs/int8.md (OpenVINO section).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from minilm_int8 import build_stages, eager_runner, ort_runner, outputs_of, time_interleaved  # noqa: E402

# name -> openvino pass params; each hangs after `simplify`.
# int8 and bf16 variants run on every CPU here (skip_slow: false): this bench measures the very
# comparisons the pass's CPU rules rest on (bench/openvino_isa.py: int8 under each oneDNN ISA).
VARIANTS = {
    "ov-fp32": {"precision": "fp32"},
    "ov-bf16": {"precision": "bf16"},
    # The recipe's own `ov-int8` stage where it has one (its params, the guard off): main() puts them here. The
    # default recipe's SmoothQuant alpha 0.85 is not NNCF's 0.95 (ov-int8-nncf-alpha), and the worst sentence differs.
    "ov-int8": {"precision": "int8", "guard": False},  # the preset this CPU class takes (passes/_openvino_isa.int8_preset)
    "ov-int8-nncf-alpha": {"precision": "int8", "guard": False},  # NNCF's SmoothQuant alpha (0.95 for MatMuls)
    "ov-int8-mixed": {"precision": "int8", "preset": "mixed", "guard": False},  # NNCF's default for transformers
    "ov-int8-performance": {"precision": "int8", "preset": "performance", "guard": False},
    "ov-int8-sq0.5": {"precision": "int8", "smooth_quant_alpha": 0.5, "guard": False},
    "ov-int8-nosq": {"precision": "int8", "smooth_quant_alpha": -1, "guard": False},
    "ov-int8-fullbc": {"precision": "int8", "fast_bias_correction": False, "guard": False},
    "ov-int8-guard": {"precision": "int8", "guard": True},
}
VARIANTS = {name: params | ({"skip_slow": False} if params["precision"] != "fp32" else {}) for name, params in VARIANTS.items()}


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    from optpipe.evaluation import openvino_runtime as ovr
    from optpipe.recipe.schema import StageSpec
    from optpipe.safety.recipe_loading import load_recipe

    recipe = load_recipe(args.recipe)
    if args.calibration_samples:
        recipe.data.calibration.samples = args.calibration_samples
    own = recipe.stages.get("ov-int8")
    if own is not None and own.pass_name == "openvino":
        VARIANTS["ov-int8"] = {**own.params, "guard": False, "skip_slow": False}
    recipe.stages = {name: spec for name, spec in recipe.stages.items() if name in ("export", "simplify")}
    wanted = args.variants.split(",") if args.variants else list(VARIANTS)
    for name in wanted:
        recipe.stages[name] = StageSpec.model_validate({"pass": "openvino", "after": "simplify", "params": VARIANTS[name]})
    stages, services = build_stages(recipe, args.run_dir)
    samples = services.eval_set().arrays
    runners = {"pytorch-eager": eager_runner(services.torch_model(), args.threads), "ort-fp32 (simplify)": ort_runner(stages["simplify"].path, args.threads)}
    facts = {}
    for name in wanted:
        if name not in stages:
            continue
        path, hint, names = ovr.stage_settings(stages[name])
        compiled = ovr.compile_model(path, args.threads, hint)
        facts[name] = ovr.precision_facts(compiled)
        run = ovr.runner(compiled, names)
        runners[name] = lambda feeds, run=run: run(feeds)["last_hidden_state"]

    reference = outputs_of(runners["pytorch-eager"], samples, 8)
    mask = samples["attention_mask"].astype(bool)
    cosines = {name: sentence_cosines(outputs_of(run, samples, 8), reference, mask) for name, run in runners.items()}
    for batch in [int(b) for b in args.batch.split(",")]:
        feeds = {name: array[:batch] for name, array in samples.items()}
        load_before = os.getloadavg()
        times = time_interleaved(runners, feeds, args.threads, args.warmup, args.rounds, args.iterations)
        load_after = os.getloadavg()
        eager = np.median(times["pytorch-eager"])
        print(f"\nMiniLM-L6, batch {batch} x 128, {args.threads} threads, {args.rounds} rounds x {args.iterations}, "
              f"{recipe.data.calibration.samples} calibration sentences; load {load_before[0]:.2f} -> {load_after[0]:.2f}; {cpu_line()}")
        print("| model | p50 ms | p90/p50 | vs eager | token cosine | worst sentence | precision | int8 layers |")
        print("|---|---|---|---|---|---|---|---|")
        for name, ms in times.items():
            mean, worst = cosines[name]
            f = facts.get(name, {})
            print(f"| {name} | {np.median(ms):.2f} | {np.percentile(ms, 90) / np.median(ms):.2f} | {eager / np.median(ms):.2f}x "
                  f"| {mean:.4f} | {worst:.4f} | {f.get('inference_precision', '')} | {f.get('int8_layers', '')} |", flush=True)


def sentence_cosines(candidate: np.ndarray, reference: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """Mean token cosine over real tokens, and the lowest per-sentence mean."""
    a, b = candidate.astype(np.float64), reference.astype(np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    per_sentence = [(c[m]).mean() for c, m in zip(cos, mask)]
    return float(cos[mask].mean()), float(min(per_sentence))


def cpu_line() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    isa = [f for f in flags if f.startswith("amx") or f in ("avx512_vnni", "avx_vnni", "avx512_bf16")]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no AMX/VNNI/BF16'}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "minilm.yaml"))
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "bench-openvino"))
    parser.add_argument("--variants", help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (each timed in this process)")
    parser.add_argument("--calibration-samples", type=int, help="override the recipe's calibration sentences (NNCF subset)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=10)
    return parser.parse_args()


if __name__ == "__main__":
    main()
