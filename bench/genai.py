"""optpipe's decoder artifacts in their GenAI runtimes against optpipe's own generation loop, side by side.

    python bench/genai.py /tmp/genai-bench --size 0.1b --threads 1

Builds a Llama-style decoder (random weights, bench/llm.py's SIZES), exports it with its KV cache,
converts it to an IR (FP32, and NNCF INT4_SYM, --group-size), writes the GenAI folders the targets write
(targets/openvino_genai.py, targets/ort_genai.py) and times, interleaved round by round in one process:
optpipe's loop on ONNX Runtime and OpenVINO, onnxruntime_genai on the same model.onnx, and
openvino_genai.LLMPipeline on the stateful IR. Each runtime generates 1 token (TTFT, the prefill) and
N tokens from the same prompt; decode tokens/s = (N - 1) / (t_N - t_1); medians over the rounds.
Greedy tokens are compared with optpipe's loop on the same model. Prints a Markdown table with the load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm import SIZES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--size", default="0.1b", choices=sorted(SIZES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=128, help="NNCF INT4 group size (must divide the channels)")
    args = parser.parse_args()
    runners, layout = prepare(args)
    prompt = (np.arange(args.prompt, dtype=np.int64)[None] * 7 + 3) % layout.vocab
    rows = measure(runners, prompt, args.new_tokens, args.rounds)
    print(f"\n{args.size}, {args.threads} thread(s), prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f}, {cpu_class()}\n")
    print("| runtime | model | TTFT ms | decode tok/s | vs optpipe loop | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, model, ttft, tps, base, same in rows:
        print(f"| {name} | {model} | {ttft:.1f} | {tps:.1f} | {tps / base:.2f}x | {same} |")


def prepare(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import nncf
    import onnx

    from optpipe.evaluation import generation as gen
    from optpipe.evaluation import openvino_runtime as ovr
    from optpipe.source.decoder_export import export_decoder
    from optpipe.targets import openvino_genai, ort_genai

    folder = args.folder
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, **SIZES[args.size])).eval()
    max_past = args.prompt + args.new_tokens + 1
    layout = export_decoder(model, folder / "ort", max_batch=1, max_sequence=max(args.prompt, 2), max_past=max_past)
    del model
    graph = onnx.load(str(folder / "ort" / "model.onnx"), load_external_data=False).graph
    ort_genai.write_genai(folder / "ort", graph, None, args.threads)
    config = ovr.compile_config(args.threads)
    ovr.save_ir(ovr.convert_onnx(folder / "ort" / "model.onnx"), folder / "ov-fp32")
    int4 = nncf.compress_weights(ovr.read_model(folder / "ov-fp32" / ovr.IR_FILE), mode=nncf.CompressWeightsMode.INT4_SYM,
                                 group_size=args.group_size)
    ovr.save_ir(int4, folder / "ov-int4")
    del int4
    for name in ("ov-fp32", "ov-int4"):
        openvino_genai.write_genai(folder / name / ovr.IR_FILE, folder / name, None, config)
    loop = lambda runner: (lambda p, n: gen.greedy(runner, layout, p, n).tokens[0])  # noqa: E731
    runners = [
        ("optpipe loop (ORT)", "fp32", loop(gen.OrtRunner(folder / "ort" / "model.onnx", layout, args.threads))),
        ("onnxruntime-genai", "fp32", ort_genai_runner(folder / "ort")),
        ("optpipe loop (OpenVINO)", "fp32", loop(gen.OpenVinoRunner(folder / "ov-fp32" / ovr.IR_FILE, layout, args.threads))),
        ("openvino-genai", "fp32", llm_pipeline_runner(folder / "ov-fp32" / "genai", config)),
        ("optpipe loop (OpenVINO)", "int4", loop(gen.OpenVinoRunner(folder / "ov-int4" / ovr.IR_FILE, layout, args.threads))),
        ("openvino-genai", "int4", llm_pipeline_runner(folder / "ov-int4" / "genai", config)),
    ]
    return runners, layout


def ort_genai_runner(folder: Path):
    """onnxruntime_genai with its Model loaded once (a Generator per generation, as its examples do)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def run(prompt, new_tokens):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt.shape[1] + new_tokens, do_sample=False, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt.astype(np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return np.asarray(generator.get_sequence(0), np.int64)[prompt.shape[1]:]

    return run


def llm_pipeline_runner(folder: Path, properties: dict):
    """openvino_genai.LLMPipeline compiled once, greedy with ignore_eos (exactly N tokens)."""
    import openvino as ov
    import openvino_genai as og

    pipe = og.LLMPipeline(str(folder), "CPU", **properties)
    config = pipe.get_generation_config()
    config.do_sample, config.ignore_eos = False, True
    if config.eos_token_id < 0:
        config.eos_token_id, config.stop_token_ids = 0, {0}

    def run(prompt, new_tokens):
        config.max_new_tokens = new_tokens
        inputs = og.TokenizedInputs(ov.Tensor(prompt), ov.Tensor(np.ones_like(prompt)))
        return np.asarray(pipe.generate(inputs, config).tokens[0], np.int64)

    return run


def measure(runners, prompt, new_tokens, rounds):
    """Interleaved: every runtime generates 1 and then N tokens once per round; medians of each."""
    times = {i: {"t1": [], "tn": [], "tokens": None} for i in range(len(runners))}
    for i, (_, _, run) in enumerate(runners):
        run(prompt, 2)  # warm-up: first-call allocations, kernel choice
    for _ in range(rounds):
        for i, (_, _, run) in enumerate(runners):
            started = time.perf_counter()
            run(prompt, 1)
            times[i]["t1"].append(time.perf_counter() - started)
            started = time.perf_counter()
            times[i]["tokens"] = np.asarray(run(prompt, new_tokens))
            times[i]["tn"].append(time.perf_counter() - started)
    rows = []
    base = {}
    for i, (name, model, _) in enumerate(runners):
        t1, tn = statistics.median(times[i]["t1"]), statistics.median(times[i]["tn"])
        tps = (new_tokens - 1) / max(tn - t1, 1e-9)
        if name.startswith("optpipe"):
            base[model, name.split("(")[1].rstrip(")") if "(" in name else ""] = (tps, times[i]["tokens"])
        runtime = "ORT" if "onnxruntime" in name or "ORT" in name else "OpenVINO"
        ref_tps, ref_tokens = base[model, runtime]
        same = "yes" if np.array_equal(times[i]["tokens"], ref_tokens) else "no"
        rows.append((name, model, t1 * 1e3, tps, ref_tps, same))
    return rows


def cpu_class() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
    return "AMX + AVX-512 VNNI" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2"


if __name__ == "__main__":
    main()
