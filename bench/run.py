"""Benchmark suite: PyTorch eager FP32, plain ONNX Runtime FP32 and every optpipe stage, side by side.

    python bench/run.py recipes/minilm.yaml recipes/bert-base.yaml recipes/resnet50.yaml recipes/yolov5s.yaml

Each recipe is compiled with optpipe (cached: an unchanged recipe recomputes
nothing), then measured in its own process: every candidate runs on the same
inputs, interleaved round by round (so drift on a shared machine hits all
candidates alike), threads pinned, after warm-up. The table gives p50/p90, the
speed-up against PyTorch eager (a ratio from this one run; absolute times on a
shared machine drift) and, beside it, the accuracy the optpipe report measured
for that model on the recipe's evaluation data. Results go to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EAGER, PLAIN_ORT, PLAIN_OV = "pytorch-eager", "onnxruntime-fp32 (plain)", "openvino (plain)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (every candidate once per round)")
    parser.add_argument("--iterations", type=int, default=10, help="timed runs per candidate per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per candidate first")
    parser.add_argument("--batch", type=int, help="batch size (default: the recipe's first batch size)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md", help="Markdown file to write")
    parser.add_argument("--no-peers", action="store_true", help="skip Optimum/Olive rows (see bench/peers.py)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: measure one recipe, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(bench_recipe(args.recipes[0], args)))
        return 0
    results = [run_in_own_process(recipe, args) for recipe in args.recipes]
    for result in results:
        print(render_model(result), "\n", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render_document(results, command=" ".join(["python", "bench/run.py"] + (argv or sys.argv[1:]))))
    print(f"written: {args.output}")
    return 0 if all("error" not in r for r in results) else 1


def run_in_own_process(recipe: Path, args) -> dict:
    """One process per model: models don't share memory, threads or warm caches."""
    if not recipe.is_file():
        return {"recipe": str(recipe), "error": f"recipe '{recipe}' does not exist"}
    command = [sys.executable, __file__, str(recipe), "--one", "--rounds", str(args.rounds), "--iterations", str(args.iterations),
               "--warmup", str(args.warmup)] + (["--batch", str(args.batch)] if args.batch else []) + (["--no-peers"] if args.no_peers else [])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"benchmarking {recipe} ... CPU class: {cpu_class_line()}; flags: {isa_flags()}; "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}; load {load}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"recipe": str(recipe), "error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- one model -----------------------------------------------------------------------------


def bench_recipe(recipe_path: Path, args) -> dict:
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    recipe = load_recipe(recipe_path)
    started = time.perf_counter()
    report = compile_recipe(recipe, RunOptions())
    compile_s = time.perf_counter() - started
    run_dir = recipe.resolve(recipe.output)
    batch = args.batch or recipe.evaluate.batch_sizes[0]
    threads = recipe.evaluate.threads
    reference = ReferenceOutputs(recipe, report, run_dir, threads)
    candidates, rows = build_candidates(recipe, report, run_dir, threads, reference)
    feeds = evaluation_feeds(recipe, batch)
    if not getattr(args, "no_peers", False):
        add_peers(recipe, threads, candidates, rows, reference)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    timings = interleaved_timings(candidates, feeds, threads, args.rounds, args.iterations, args.warmup)
    eager_p50 = float(np.median(timings[EAGER])) if EAGER in timings else None
    for row in rows:
        times = timings.get(row["candidate"])
        if times is None:
            continue
        row["p50_ms"] = float(np.median(times))
        row["p90_ms"] = float(np.percentile(times, 90))
        row["speedup_vs_eager"] = eager_p50 / row["p50_ms"] if eager_p50 else None
        row["busy"] = busy_in_rounds(times, args.iterations, timings.get(EAGER))
    return {
        "recipe": str(recipe_path),
        "model": recipe.name,
        "batch": batch,
        "shapes": {name: list(a.shape) for name, a in feeds.items()},
        "threads": threads,
        "samples_timed": args.rounds * args.iterations,
        "reference": report.reference,
        "compile_s": round(compile_s, 1),
        # Other work on the machine distorts ratios (PyTorch eager's thread barriers most): keep the load beside them.
        "load_average": load_before,
        "load_average_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "isa": isa_flags(),
        "cpu_class": cpu_class_line(),
        "rows": rows,
    }


def busy_in_rounds(times: list[float], per_round: int, eager: list[float] | None) -> str | None:
    """optpipe's busy-machine verdict (tail, round-to-round spread) on this candidate and on eager."""
    from optpipe.evaluation.latency import busy_reason

    def verdict(values):
        rounds = [float(np.median(values[i:i + per_round])) for i in range(0, len(values), per_round)]
        return busy_reason(np.asarray(values), rounds)

    reasons = [verdict(times)] + ([f"eager: {verdict(eager)}"] if eager and verdict(eager) else [])
    return "; ".join(r for r in reasons if r) or None


def isa_flags() -> str:
    """The CPU features INT8/BF16 speed depends on: AMX, AVX-512 VNNI, AVX-VNNI, AVX-512 BF16."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return "unknown"
    wanted = ["avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16", "avx512_vnni", "avx_vnni", "avx512_bf16"]
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)


def cpu_class_line() -> str:
    """The CPU class each engine runs at: OpenVINO's (held by ONEDNN_MAX_CPU_ISA where set), ORT's and PyTorch's
    (the CPU's own: OPTPIPE_CPU_FEATURES changes optpipe's choices, never their kernels)."""
    from optpipe.hardware.cpu_features import engine_target, hardware_target, machine_target

    machine, openvino, kernels = machine_target(), engine_target("openvino"), hardware_target()
    injected = machine.cpu_class != kernels.cpu_class
    choices = f"optpipe's choices for {machine.cpu_class} (OPTPIPE_CPU_FEATURES); " if injected else ""
    if openvino.restricted_by or injected:
        at = f"OpenVINO at {openvino.cpu_class}" + (f" ({openvino.restricted_by})" if openvino.restricted_by else "")
        return (f"{choices}{at}; ONNX Runtime and PyTorch kernels at the CPU's own class, {kernels.cpu_class} "
                "(they have no switch to lower their ISA)")
    return f"{machine.cpu_class} (every engine)"


def build_candidates(recipe, report, run_dir: Path, threads: int, reference: "ReferenceOutputs") -> tuple[dict[str, Callable], list[dict]]:
    """Runnables and their report rows: eager, plain ORT and plain OpenVINO on the exported model, every finished stage."""
    from optpipe.core.runtime import eager_runner, ort_runner, session_options

    candidates: dict[str, Callable] = {}
    rows: list[dict] = []
    eager = report.stage(EAGER)
    if eager is not None and eager.status == "ok":
        from optpipe.source.model_source import load_torch_model

        candidates[EAGER] = eager_runner(load_torch_model(recipe.model_source()), threads)
        rows.append(_row(EAGER, "PyTorch eager FP32", eager))
    root = next((s for s in report.stages if s.parent is None and s.name != EAGER and s.status == "ok"), None)
    if root is not None:
        import onnxruntime as ort

        # "Plain": ONNX Runtime as a user would run the exported file, only the thread count set.
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        candidates[PLAIN_ORT] = ort_runner(_session(run_dir / "stages" / root.name / "model.onnx", options))
        rows.append(_row(PLAIN_ORT, f"ORT defaults on the exported model ({root.name})", root))
        if any(s.pass_name == "openvino" for s in report.stages):
            run, precision = _openvino_plain(run_dir / "stages" / root.name / "model.onnx", threads)
            candidates[PLAIN_OV] = run
            # OpenVINO's default hint is bf16 on a CPU with bf16 instructions: the export's accuracy is not this
            # row's, so its own outputs are compared, as the peers' are.
            rows.append({**_row(PLAIN_OV, f"OpenVINO reading the exported model ({root.name}), only the threads set "
                                f"(runs at {precision})", root), **reference.accuracy(run)})
    for stage in report.stages:
        if stage.name == EAGER:
            continue
        if stage.status != "ok":
            rows.append({"candidate": f"optpipe:{stage.name}", "what": f"{stage.pass_name} ({stage.status}: {stage.reason})"})
            continue
        folder = run_dir / "stages" / stage.name
        what = stage.pass_name + (f" after {stage.parent}" if stage.parent else "")
        if (folder / "model.xml").is_file():  # an `openvino` stage: OpenVINO's runtime, as the report measured it
            candidates[f"optpipe:{stage.name}"] = _openvino_stage(folder, stage, threads)
            what += f" (OpenVINO, {stage.info.get('precision')}, runs at {stage.info.get('inference_precision')})"
        else:
            candidates[f"optpipe:{stage.name}"] = ort_runner(_session(folder / "model.onnx", session_options(threads)))
        rows.append(_row(f"optpipe:{stage.name}", what, stage))
    return candidates, rows


def _openvino_stage(folder: Path, stage, threads: int) -> Callable:
    """An IR stage compiled with the settings the report measured it with (one latency stream, its hint)."""
    from optpipe.evaluation import openvino_runtime as ovr

    hint = ovr.read_settings(folder)["hint"]
    return ovr.runner(ovr.compile_model(folder / ovr.IR_FILE, threads, hint), stage.info.get("output_names"))


def _openvino_plain(path: Path, threads: int) -> tuple[Callable, str]:
    """OpenVINO as a user would run the exported ONNX: `compile_model(path, "CPU")` with only the thread count set;
    and the precision it chose to run at."""
    from optpipe.evaluation import openvino_runtime as ovr

    compiled = ovr.core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads})
    return ovr.runner(compiled, ovr.output_names(path)), ovr.inference_precision(compiled)


class _EvalData(NamedTuple):  # a NamedTuple: the tests load this file by path, which a dataclass's annotations cannot
    batches: list      # the recipe's evaluation feeds, in accuracy batches
    arrays: dict       # the same inputs whole (what the comparison's input-sensitivity check reads)
    expected: dict     # the reference stage's outputs on them


class ReferenceOutputs:
    """The reference stage's outputs on the recipe's evaluation data, computed once: what the rows whose
    accuracy no optpipe report measured (the peers, plain OpenVINO) are compared against, with optpipe's
    own comparison (the figure the report gives each stage)."""

    def __init__(self, recipe, report, run_dir: Path, threads: int):
        self.recipe, self.report, self.threads = recipe, report, threads
        self.path = run_dir / "stages" / (report.reference or "") / "model.onnx"
        self._eval: _EvalData | None = None

    def _data(self) -> _EvalData:
        if self._eval is None:
            from optpipe.cache.store import StageCache, default_cache_dir
            from optpipe.calibration.dataset import build_sample_set
            from optpipe.evaluation.accuracy import run_onnx

            recipe = self.recipe
            cache = StageCache(recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir())
            sample_set = build_sample_set(recipe.data.eval, recipe.model_source(), cache.root)
            batches = list(sample_set.batches(recipe.evaluate.accuracy_batch))
            self._eval = _EvalData(batches, sample_set.arrays, run_onnx(self.path, batches, self.threads, ["CPUExecutionProvider"]))
        return self._eval

    def accuracy(self, run: Callable | Path) -> dict:
        """Row fields (cosine, max_abs, within_tolerance) of a runnable or an ONNX file; {} without a reference.
        Outputs are matched to the reference's by position: peers name theirs their own way, and Optimum's
        feature-extraction export has last_hidden_state only (compared on the outputs it has)."""
        if not self.path.is_file():
            return {}
        from optpipe.evaluation.accuracy import compare, run_onnx

        data = self._data()
        got = run_onnx(run, data.batches, self.threads, ["CPUExecutionProvider"]) if isinstance(run, Path) else _outputs(run, data.batches)
        got = dict(zip(data.expected, got.values()))
        evaluate = self.recipe.evaluate
        accuracy = compare(got, {k: data.expected[k] for k in got}, data.arrays, evaluate.tolerance, self.report.reference, evaluate.top1)
        return {"cosine": accuracy.worst_cosine, "max_abs": max(o.max_abs for o in accuracy.outputs),
                "within_tolerance": accuracy.within_tolerance}


def add_peers(recipe, threads: int, candidates: dict, rows: list[dict], reference: ReferenceOutputs) -> None:
    """Optimum's and Olive's own results (bench/peers.py), timed here beside optpipe's stages, their accuracy
    measured against the reference stage's outputs."""
    sys.path.insert(0, str(Path(__file__).parent))
    from peers import peer_models

    from optpipe.core.runtime import ort_runner, session_options

    for name, (what, result) in peer_models(recipe).items():
        if not isinstance(result, Path):
            print(f"  {name}: {result}", file=sys.stderr)
            rows.append({"candidate": name, "what": f"{what} ({result})"})
            continue
        if result.suffix == ".xml":  # an OpenVINO IR (plain NNCF): OpenVINO's runtime, compiled as optpipe's IR stages are
            from optpipe.evaluation import openvino_runtime as ovr

            candidates[name] = _named_like(ovr.runner(ovr.compile_model(result, threads)), reference.path)
            size = result.with_suffix(".bin").stat().st_size
        else:
            candidates[name] = ort_runner(_session(result, session_options(threads)))
            size = result.stat().st_size
        measured = reference.accuracy(candidates[name] if result.suffix == ".xml" else result)
        rows.append({"candidate": name, "what": what, "size_mb": size / 1e6, **measured})


def _named_like(run: Callable, reference: Path) -> Callable:
    """An IR's outputs under the reference ONNX's output names, by position (as the peers' ONNX outputs are matched)."""
    from optpipe.evaluation import openvino_runtime as ovr

    names = ovr.output_names(reference) if reference.is_file() else None

    def named(feeds):
        outs = run(feeds)
        return dict(zip(names, outs.values())) if names else outs

    return named


def _outputs(run: Callable, batches: list[dict]) -> dict:
    outs = [run(batch) for batch in batches]
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def _session(path: Path, options):
    """A CPU session whose idle threads sleep instead of spinning.

    Measured here (MiniLM, 2 cores): with three idle spinning sessions in the process,
    PyTorch eager went from 72 ms to 1226 ms and each ORT session from 38 ms to 107 ms.
    Side by side in one process, spinning measures the neighbours, not the candidate.
    """
    import onnxruntime as ort

    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _row(candidate: str, what: str, stage) -> dict:
    acc = stage.accuracy
    return {
        "candidate": candidate,
        "what": what,
        "cosine": acc.worst_cosine if acc else None,
        "max_abs": max((o.max_abs for o in acc.outputs), default=None) if acc else None,
        "top1": next((o.top1 for o in acc.outputs if o.top1 is not None), None) if acc else None,
        "within_tolerance": acc.within_tolerance if acc else None,
        "size_mb": stage.size_bytes / 1e6 if stage.size_bytes else None,
        "frontier": stage.pareto,
    }


def evaluation_feeds(recipe, batch: int) -> dict[str, np.ndarray]:
    """The recipe's evaluation samples (real text or images where the recipe has them), `batch` of them."""
    from optpipe.cache.store import StageCache, default_cache_dir
    from optpipe.calibration.dataset import build_sample_set

    cache = StageCache(recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir())
    return build_sample_set(recipe.data.eval, recipe.model_source(), cache.root).first(batch)


def interleaved_timings(candidates: dict[str, Callable], feeds, threads: int, rounds: int, iterations: int, warmup: int) -> dict[str, list[float]]:
    from optpipe.core.runtime import pinned_threads

    times: dict[str, list[float]] = {name: [] for name in candidates}
    with pinned_threads(threads):
        for run in candidates.values():
            for _ in range(warmup):
                run(feeds)
        for round_ in range(rounds):
            # Rotate the order each round so no candidate always runs right after the same one.
            names = list(candidates)
            names = names[round_ % len(names):] + names[: round_ % len(names)]
            for name in names:
                for _ in range(iterations):
                    start = time.perf_counter()
                    candidates[name](feeds)
                    times[name].append((time.perf_counter() - start) * 1e3)
            print(f"  round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
    return times


# --- Markdown ------------------------------------------------------------------------------


def render_model(result: dict) -> str:
    title = f"### {result.get('model', result['recipe'])} (`{result['recipe']}`)"
    if "error" in result:
        return f"{title}\n\nnot measured: {result['error']}"
    shapes = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in result["shapes"].items())
    lines = [title, "", f"batch {result['batch']} ({shapes}), {result['threads']} threads, {result['samples_timed']} timed runs per "
             f"candidate; accuracy against `{result['reference']}` from the optpipe report; "
             f"1-minute load average {cell(result.get('load_average'), '.1f')} when timing started, "
             f"{cell(result.get('load_average_after'), '.1f')} when it ended; CPU class: {result.get('cpu_class', 'unknown')}; "
             f"CPU features: {result.get('isa', 'unknown')}. "
             "⚠busy: that candidate's (or eager's) p90/p50 or round-to-round spread says the machine was busy.", ""]
    lines += markdown_table(
        ["candidate", "what", "p50 ms", "p90 ms", "speed-up vs eager", "cosine", "max abs", "top-1", "within tolerance", "size MB"],
        [[r["candidate"] + (" ★" if r.get("frontier") else ""), r["what"], cell(r.get("p50_ms"), ".2f"), cell(r.get("p90_ms"), ".2f"),
          cell(r.get("speedup_vs_eager"), ".2f", "x") + (" ⚠busy" if r.get("busy") else ""), cell(r.get("cosine"), ".5f"), cell(r.get("max_abs"), ".2e"), cell(r.get("top1"), ".3f"),
          {True: "yes", False: "**no**", None: ""}[r.get("within_tolerance")], cell(r.get("size_mb"), ".1f")]
         for r in result["rows"]])
    return "\n".join(lines + [""] + verdict_lines(result["rows"]) + injected_note(result.get("cpu_class", "")))


def injected_note(cpu_line: str) -> list[str]:
    """Under OPTPIPE_CPU_FEATURES the verdicts mix classes: say which of the figures are not the injected class's."""
    if "(OPTPIPE_CPU_FEATURES)" not in cpu_line:
        return []
    return ["", "The CPU's features were injected (OPTPIPE_CPU_FEATURES): optpipe chose for that class, but ONNX Runtime "
            "and PyTorch ran this CPU's own kernels, so their rows' speeds, and the accuracy of formats that saturate only "
            "on the injected class (u8s8 without VNNI), are this CPU's; the verdicts above hold for the OpenVINO rows "
            "(under ONEDNN_MAX_CPU_ISA) and for the accuracy of saturation-free formats."]


def verdict_lines(rows: list[dict]) -> list[str]:
    """The issue-17 comparison in words: optpipe's best within tolerance, its ORT-only best, the best peer."""
    timed = [r for r in rows if r.get("speedup_vs_eager") and r.get("within_tolerance")]
    ours = [r for r in timed if r["candidate"].startswith("optpipe:")]
    ort = [r for r in ours if "OpenVINO" not in r.get("what", "")]
    peers = [r for r in timed if r["candidate"].split(":")[0] in ("optimum", "olive", "nncf")]

    def best(group):
        return max(group, key=lambda r: r["speedup_vs_eager"], default=None)

    def say(r):
        return f"`{r['candidate']}` {r['speedup_vs_eager']:.2f}x at cosine {r['cosine']:.4f}" if r else "none"

    lines = [f"Best within tolerance: optpipe {say(best(ours))}; optpipe ONNX Runtime only {say(best(ort))}; "
             f"best peer {say(best(peers))}."]
    # Issue 17's test, peer by peer: optpipe's fastest at equal or better accuracy than that peer's.
    for peer in sorted(peers, key=lambda r: -r["speedup_vs_eager"]):
        for side, group in (("optpipe", ours), ("ONNX Runtime only", ort)):
            match = best([r for r in group if r["cosine"] is not None and r["cosine"] >= peer["cosine"]])
            verdict = "none at that accuracy" if match is None else \
                f"{say(match)}: {speed_verdict(match['speedup_vs_eager'] / peer['speedup_vs_eager'])}"
            lines.append(f"- vs `{peer['candidate']}` ({peer['speedup_vs_eager']:.2f}x at {peer['cosine']:.4f}), {side}: {verdict}")
    return lines


def speed_verdict(ratio: float) -> str:
    """optpipe's speed over a peer's in words. Within the report's latency noise (5%: two p50s of one
    interleaved run closer than that are no trade-off, optpipe.reporting.run_report) it is "level": the
    same NNCF IR timed twice in one run came out 1.2% apart (docs/benchmarks.md)."""
    from optpipe.reporting.run_report import LATENCY_NOISE

    if ratio >= 1 + LATENCY_NOISE:
        return f"faster ({ratio:.2f}x its speed)"
    if ratio > 1 - LATENCY_NOISE:
        return f"level ({ratio:.2f}x its speed, within the {LATENCY_NOISE:.0%} noise)"
    return f"**slower** ({ratio:.2f}x its speed)"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines (bench/gpu_rows.py writes its tables with it too)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(row) + " |" for row in rows]


def render_document(results: list[dict], command: str) -> str:
    from optpipe.reporting.run_report import machine_description

    m = machine_description()
    libs = ", ".join(f"{k} {v}" for k, v in m["libraries"].items() if v)
    parts = [
        "# Benchmarks", "",
        f"Produced by `{command}` on {datetime.now(timezone.utc).date().isoformat()}.", "",
        f"Machine: {m['processor']}, {m['cores']} cores visible ({os.cpu_count()}), {m['platform']}, Python {m['python']}; {libs}.", "",
        "Method: every candidate of a model runs in one process on the same inputs, interleaved round by round with "
        "rotating order, threads pinned, after warm-up, ONNX Runtime thread spinning off (idle spinning sessions would "
        "slow their neighbours); p50/p90 over all timed runs. Speed-ups are p50 ratios against "
        "PyTorch eager from this one run: absolute times drift on a shared machine, the ratios are the result. "
        "Accuracy is what `optpipe compile` measured for each stage against the reference stage on the recipe's "
        "evaluation data (for models with random weights it says little about a trained model). ★ marks the Pareto frontier. "
        "Peers (Hugging Face models only): `optimum:*` and `olive:*` rows are the files those tools wrote with their own "
        "documented commands (bench/peers.py), timed here beside the stages; their accuracy is optpipe's comparison "
        "against the same reference. GPU rows: docs/benchmarks-gpu.md (scripts/gpu_checks.sh).", "",
    ]
    parts += [render_model(r) + "\n" for r in results]
    return "\n".join(parts)


def cell(value, fmt: str, suffix: str = "") -> str:
    """A table cell: the value formatted, or empty where it was not measured."""
    return "" if value is None else format(value, fmt) + suffix


if __name__ == "__main__":
    sys.exit(main())
