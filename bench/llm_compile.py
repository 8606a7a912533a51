"""A Llama-style decoder through `optpipe compile` itself, in ONE process (issue 20): what a user runs.

    python bench/llm.py /tmp/llmc --compile --size 0.5b        # 0.37 B params, 1.47 GB FP32
    python bench/llm.py /tmp/llmc1b --compile --size 1b        # 1.1 B (TinyLlama's shape), 4.40 GB FP32

bench/llm.py's other mode runs each step in its own process; this one writes recipes/llm-int4.yaml's
stages with the size's config (random seeded weights) and compiles it through the pass manager
(compile_recipe) with bench/memory.py's RSS probe (a thread sampling this process plus its children
every 10 ms; a phase per stage, evaluation and target). The torch model held for the eager rows, the
export, each pass, each stage's generation evaluation and the report all share this process, so the
table shows what stays resident from one phase to the next. Prints per phase the RSS at start and
peak (GB and x the FP32 weights), the memory preflight's estimate per stage beside it, and per stage
the size on disk, TTFT, decode tok/s and its ratio to eager with its KV cache.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from memory import RssProbe, make_instrument  # noqa: E402  (bench/ is scripts, not a package)


def write_recipe(folder: Path, config: dict, stages: list[str] | None, new_tokens: int, threads: int) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "llm-int4.yaml").read_text())
    recipe["name"] = "llm-compile-memory"
    recipe["model"]["hf_config"] = {"model_type": "llama", "max_position_embeddings": 2048, "tie_word_embeddings": False, **config}
    recipe["inputs"][0]["range"] = [0, config["vocab_size"]]
    recipe["dims"]["sequence"] = {"min": 2, "opt": 16, "max": 64}
    if stages:
        recipe["stages"] = {name: spec for name, spec in recipe["stages"].items() if name in stages}
        for spec in recipe["stages"].values():  # a stage whose parent was dropped takes the export
            if spec.get("after") and spec["after"] not in recipe["stages"]:
                spec["after"] = "export"
    # Few tokens and one round: this run is about memory; bench/llm.py's default mode measures speed.
    recipe["evaluate"]["generation"].update(new_tokens=new_tokens, batch_sizes=[1], rounds=1, text_tokens=64,
                                            text=str(ROOT / "docs" / "architecture.md"))
    recipe["evaluate"].update(threads=threads, warmup=1, iterations=3)
    recipe["output"] = str(folder / "run")
    recipe["cache"] = str(folder / "cache")
    path = folder / "llm-compile.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run(folder: Path, size: str, config: dict, stages: list[str] | None, new_tokens: int, threads: int, cold: bool) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    if cold:
        shutil.rmtree(folder / "cache", ignore_errors=True)
    path = write_recipe(folder, config, stages, new_tokens, threads)
    probe = RssProbe()
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    probe.mark("imports")
    recipe = load_recipe(path)
    estimates = preflight_estimates(recipe)
    started = time.perf_counter()
    report = compile_recipe(recipe, RunOptions(instruments=[make_instrument(probe)], force=cold))
    probe.close()
    fp32 = fp32_gb(config)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\nLlama-style {size} ({fp32 / 4:.3f} B params, FP32 {fp32:.2f} GB, random weights) through compile_recipe "
          f"in one process, {time.perf_counter() - started:.0f} s, threads {threads}, CPU {cpu_class()}, load {' '.join(load)}")
    print(f"| phase | RSS at start GB | peak GB | peak x FP32 | preflight estimate GB |\n|---|---|---|---|---|")
    for label, start, peak in probe.rows:
        # A pass's own estimate; every evaluation row gets eager's (eager beside the stage, or alone where it is
        # timed apart: the evaluations' bound).
        stage = label.split()[-1] if label.startswith("pass ") else "pytorch-eager" if label.startswith("evaluate ") else None
        estimate = f"{estimates[stage] / 1e9:.2f}" if stage in estimates else ""
        print(f"| {label} | {start:.2f} | {peak:.2f} | {peak / fp32:.2f}x | {estimate} |")
    print(f"overall peak RSS (process + children): {probe.overall / 1e6:.2f} GB = {probe.overall / 1e6 / fp32:.2f}x the FP32 weights")
    print_stages(report, Path(recipe.output))
    return 0 if all(s.status in ("ok", "cached") for s in report.stages) else 1


def preflight_estimates(recipe) -> dict[str, int]:
    """What plan/source_preflight.py's memory check estimated per stage (bytes), to print beside the peaks."""
    from optpipe.plan.source_preflight import estimated_steps
    from optpipe.safety.memory_estimate import stage_estimates
    from optpipe.source.torch_weights import fp32_weight_bytes, held_beside_passes

    weights = fp32_weight_bytes(recipe.model_source())
    return stage_estimates(weights, estimated_steps(recipe, weights), held=held_beside_passes(weights)) if weights else {}


def print_stages(report, output: Path) -> None:
    print("| stage | status | disk GB | TTFT ms b1 | decode tok/s b1 | eager tok/s b1 | vs eager |\n|---|---|---|---|---|---|---|")
    for stage in report.stages:
        row = stage.generation.row(1) if stage.generation else None
        eager = row.eager_decode_tokens_per_s if row else None
        cells = [f"{row.ttft_ms:.1f}", f"{row.decode_tokens_per_s:.1f}", f"{eager or 0:.1f}",
                 f"{row.decode_tokens_per_s / eager:.2f}x" if eager else "-"] if row else ["-"] * 4
        disk = disk_gb((output / stage.artifact).parent) if stage.artifact else 0.0  # the model file's folder
        print(f"| {stage.name} | {stage.status} {stage.reason or ''} | {disk:.2f} | " + " | ".join(cells) + " |")


def fp32_gb(config: dict) -> float:
    from transformers import LlamaConfig

    c = LlamaConfig(**config)
    head = c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return (2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * layer + c.hidden_size) * 4 / 1e9


def disk_gb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9 if folder.exists() else 0.0


def cpu_class() -> str:
    flags = set(open("/proc/cpuinfo").read().split())
    return "AMX + AVX-512 VNNI" if "amx_tile" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2"


if __name__ == "__main__":
    print(json.dumps({"usage": "python bench/llm.py FOLDER --compile --size 0.5b"}))
