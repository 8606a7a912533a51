"""Before a run: will each stage fit in this machine's memory? An estimate from the model's FP32
weight bytes and per-pass factors measured with bench/llm.py (peak RSS of the step's own process
above the ~0.35 GB an interpreter with torch / onnxruntime / openvino imported holds), so that a
model that will not fit is refused in one line naming the stage, instead of the kernel's OOM killer
ending the run halfway.

Measured (Llama-style decoders, bench/llm.py; above the baseline, as a multiple of the FP32 weights,
at 0.1 B params / 0.40 GB and 0.37 B / 1.47 GB): export 1.6x / 1.2x (the torch model and the ONNX
being written), weight_only int4 0.9x / 1.1x and int8 1.1x / 1.3x (ORT's quantizer holds the loaded
model and the packed weights), openvino_weights 2.4x / 2.1x with openvino.convert_model and 1.2x at
0.37 B once it read the ONNX memory-mapped (Core.read_model). The factors below take the larger.
The factors are upper estimates for larger models: the copies scale with the weights, the baseline
does not.

Through `optpipe compile` in one process (bench/llm.py --compile, 0.37 B, 1.47 GB FP32; above each
phase's start): export 2.24x (the torch model is loaded inside the export phase, then the ONNX is
written beside it), onnxslim's simplify 3.95x (whole-model protobufs), weight_only int4 1.30x / int8
1.41x, openvino_weights 1.17x; a torch model under 256 MB stays resident for the eager rows from the
export to the end of the run: `held` adds it to every later stage (source/torch_weights.held_beside_passes).
A bigger one is dropped after the export since then: at 1.1 B (4.40 GB) the passes peaked at 5.55-6.29 GB
against these estimates' 6.75-7.41 GB, the export (in its own worker) at 9.70 against 10.49 (docs/llm.md).

What must fit is the anonymous memory: the rest of a peak RSS is the page cache of mapped model files, which the
kernel reclaims before its OOM killer acts, on a machine as in a container's cgroup. Gemma 3 270M's whole compile
peaked at 3.54 GB RSS and 2.70 GB anonymous, and ran to its end inside a 3.2 GB cgroup (docs/memory.md, eleventh
round). Factors measured as RSS are upper bounds of it; those below re-measured since are the anonymous peak's.
"""
from __future__ import annotations

import os

from optpipe.core.errors import UserInputError

BASELINE_BYTES = 350 << 20
#: The estimate of a KV-cache decoder's export in a worker of its own (passes/export.py WORKER_MIN_BYTES): the
#: torch model and the graph being written; the check's ONNX Runtime session runs after the worker, from eager's
#: handed-over outputs (optpipe/evaluation/self_check.py). Measured at 1.1 B: 5.38 GB, 1.14x above the baseline;
#: on Gemma 3 270M (1.07 GB, a 262k-row table tied to the head, which the check's session folds transposed):
#: 2.10 GB anonymous (2.67 RSS), 1.64x; the factor was 1.3 and let it through 0.3 GB short.
DECODER_EXPORT = "export, a KV-cache decoder in its own worker"
#: The TorchScript exporter (`exporter: torchscript`), in the compile's process: the torch model, the weights its
#: constant folding transposes for MatMul, and the serialized graph at once, inside torch.onnx. Measured on
#: BERT-large (1.34 GB FP32, x86-amx): 5.01-5.03 GB, 3.5x above the baseline (docs/memory.md, ninth round).
TORCHSCRIPT_EXPORT = "export with the TorchScript exporter"
#: OpenVINO INT8 (`openvino` with precision int8): nncf.quantize runs the FP32 model compiled by OpenVINO beside the
#: model it quantizes, and SmoothQuant writes scaled copies of the weights. Measured on BERT-large (1.34 GB): 6.01 GB,
#: 4.2x above the baseline; the same pass at fp32/bf16 3.23 GB (2.1x), ORT's dynamic int8 4.53 GB (3.1x), the
#: estimate's 2.0x floor before (docs/memory.md, ninth round).
OV_INT8 = "openvino int8 (NNCF's statistics and SmoothQuant)"
#: PyTorch eager's evaluation: eager beside each FP32 stage's ONNX Runtime session, timed interleaved. Measured
#: at 1.1 B (4.40 GB): 9.20 GB, 2.01x above the baseline; the compile's peak once the export's was lowered.
EAGER_EVALUATION = "PyTorch eager beside each FP32 stage"
#: PyTorch eager timed apart (evaluate.eager_timing): its model alone, loaded again after each stage's runtime is
#: released. Measured on Gemma 3 270M (1.07 GB): 1.24x above the baseline (its forward's activations over a 262k
#: vocabulary); the evaluations' peak there is then a stage's session, 2.6 GB against 3.33 GB interleaved.
EAGER_APART = "PyTorch eager alone, timed apart from the stages"
#: NNCF's data-aware weight compression: its statistics run the FP32 model compiled by OpenVINO's CPU plugin (a
#: repacked copy of every weight) beside the model being compressed, whose weights NNCF's layout rewrite transposed.
#: Measured on Gemma 3 270M (1.07 GB, its 262k-row embedding both a table and the LM head): 2.23x above the start
#: (2.6x when the weights were memory-mapped; docs/memory.md, seventh round). Data-free: 1.43x, in "openvino_weights".
OV_DATA_AWARE = "openvino_weights, data-aware (NNCF's statistics model)"
#: weight_only from 256 MB of weights (passes/_weight_only_on_disk.py): a worker reads each weight from disk as it
#: quantizes it and copies those left in float file to file; it holds the quantized weights and one float weight.
#: Measured on Gemma 3 270M (1.07 GB): the worker's tree 0.53 GB (int4) / 0.83 GB (int8) beside a 0.12 GB parent,
#: 0.4x / 0.67x the weights; the factor leaves room for a model whose largest weight is a larger share of it.
WEIGHT_ONLY_WORKER = "weight_only, weights read from disk (worker)"
#: weight_only with a float copy of a tied LM head (`algorithm: hqq`; the default quantizes the head from the
#: table's rows, passes/_tied_head_nbits.py): the transposed table beside the model (Gemma 3 270M, table
#: 0.67 GB: the pass's peak 2.23 -> 3.19 GB, 1.43x the table).
WEIGHT_ONLY_COPY = "weight_only, a float copy of a tied LM head (algorithm: hqq)"
#: weight_only's `algorithm: awq` (passes/_nncf_awq.py): NNCF reads the weights from disk, but its statistics run the
#: model in ONNX Runtime sessions (with extra outputs) beside the graph it compresses. Measured on Gemma 3 270M
#: (1.07 GB): NNCF's call in its process 2.45 GB, 0.45 GB of it libraries: 1.9x (8.5 GB on the loaded model).
WEIGHT_ONLY_AWQ = "weight_only, NNCF's AWQ (its statistics sessions, worker)"
#: pass -> peak RSS above the baseline, as a multiple of the FP32 weight bytes (measured, above).
PASS_FACTORS = {
    "export": 2.3, "weight_only": 1.45, "openvino_weights": 1.6, "openvino": 2.2, "int8": 3.2, OV_INT8: 4.3,
    # onnxslim in a worker with the weights left on disk (passes/_onnxslim_on_disk.py), then the self-check's session:
    # Gemma 3 270M 2.11 GB anonymous (2.23 RSS), 1.65x, its 262k-row table 62% of the weights; BERT-large 1.82 GB
    # RSS, 1.1x. It was 4.0 (whole-model protobufs in the compile's process, before the worker): Gemma's simplify,
    # which ran inside a 2.5 GB cgroup, was refused there.
    "simplify": 1.8,
    "measure": 1.2,  # a generation measurement: the weights of the runtimes it holds, plus their KV caches
    DECODER_EXPORT: 1.7, TORCHSCRIPT_EXPORT: 3.6, EAGER_EVALUATION: 2.2, EAGER_APART: 1.3, OV_DATA_AWARE: 2.4,
    WEIGHT_ONLY_WORKER: 0.9, WEIGHT_ONLY_COPY: 1.45, WEIGHT_ONLY_AWQ: 2.0,
}
#: WEIGHT_ONLY_COPY adds this much of the tied table (measured 1.43x, above).
TIED_TABLE_FACTOR = 1.5
#: A pass not measured here (fuse: 1.8x on BERT-large, fp16, prune, ...): not a measurement, a floor (a whole
#: model loaded, changed and saved is at least 2 copies); their own peaks still show in the report.
DEFAULT_FACTOR = 2.0
#: Leave this much of the available memory to everything else on the machine.
HEADROOM = 0.9


def available_bytes() -> int:
    """What this run may hold: what can be allocated without swapping (MemAvailable from /proc/meminfo, else physical
    memory; less where a container's memory limit leaves less: the kernel's OOM killer acts on the cgroup's limit, not
    the machine's memory), and what this process holds already, since each estimate counts it in its baseline."""
    from optpipe.hardware.container_limits import read_limits

    in_container = read_limits().memory_available()
    machine = _machine_available()
    return (machine if in_container is None else min(machine, in_container)) + _held_by_this_process()


def _machine_available() -> int:
    available = _proc_kb("/proc/meminfo", "MemAvailable:")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _proc_kb(path: str, field: str) -> int | None:
    """A "Field: N kB" line of a /proc file, in bytes; None where there is none (not Linux)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def where_available(available: int | None = None) -> str:
    """Whose memory a budget is: the container's, where its limit is what leaves less, else the machine's."""
    from optpipe.hardware.container_limits import read_limits

    limits = read_limits()
    in_container = limits.memory_available()
    if available is None and in_container is not None and in_container < _machine_available():
        return f"in this container (its cgroup memory limit is {limits.memory_limit / 1e9:.1f} GB)"
    return "on this machine"


def stage_estimates(fp32_bytes: int, stages: dict[str, str], held: int = 0, tied_table: int = 0) -> dict[str, int]:
    """stage name -> estimated peak RSS in bytes, for `stages` (name -> pass name); `held`: bytes the run
    keeps resident beside every stage but the export (the torch model, held for the eager rows); `tied_table`:
    an embedding table the LM head shares, which WEIGHT_ONLY_COPY writes transposed for the head (TIED_TABLE_FACTOR)."""
    return {name: int(BASELINE_BYTES + PASS_FACTORS.get(pass_name, DEFAULT_FACTOR) * fp32_bytes
                      + (held if pass_name not in ("export", DECODER_EXPORT, TORCHSCRIPT_EXPORT, EAGER_EVALUATION, EAGER_APART) else 0)
                      + (TIED_TABLE_FACTOR * tied_table if pass_name == WEIGHT_ONLY_COPY else 0))
            for name, pass_name in stages.items()}


def memory_budget(available: int | None = None) -> int:
    """What a run may take: what it may hold (available_bytes, or `available`) less the headroom."""
    return int((available if available is not None else available_bytes()) * HEADROOM)


def _held_by_this_process() -> int:
    """This process's anonymous memory (its imported libraries, the recipe's data): used already, so not in what
    is available, but each estimate's baseline counts it."""
    return _proc_kb("/proc/self/status", "RssAnon:") or 0


def over_budget(fp32_bytes: int, stages: dict[str, str], available: int | None = None, held: int = 0,
                tied_table: int = 0) -> dict[str, str]:
    """stage -> the line saying why it will not fit, for each stage whose estimate exceeds the memory available."""
    estimates = stage_estimates(fp32_bytes, stages, held, tied_table)
    budget = memory_budget(available)
    over = {name: need for name, need in estimates.items() if need > budget}
    whose = where_available(available) if over else ""  # the cgroup and /proc read once, and only to say it
    return {name: f"({stages[name]}) needs about {_gb(need, budget)} GB for a model of {fp32_bytes / 1e9:.1f} GB FP32 weights, "
                  f"and {_gb(budget, need)} GB is available {whose}: free memory, run that stage on a "
                  f"larger machine (or container), or start from a smaller model"
            for name, need in over.items()}


def _gb(value: int, other: int) -> str:
    """`value` in GB, to one decimal, or two where one would show it equal to `other` ("needs 0.8 GB, 0.8 GB available"
    read as a contradiction in a 0.9 GB container)."""
    return f"{value / 1e9:.1f}" if f"{value / 1e9:.1f}" != f"{other / 1e9:.1f}" else f"{value / 1e9:.2f}"


def refusal(refused: dict[str, str], name: str | None = None) -> UserInputError:
    """The whole run refused at stage `name` (default: the first of `refused`, over_budget's lines)."""
    name = name if name is not None else next(iter(refused))
    return UserInputError(f"stage '{name}' {refused[name]}")


def check_fits(fp32_bytes: int, stages: dict[str, str], available: int | None = None, held: int = 0,
               tied_table: int = 0) -> dict[str, int]:
    """Refuse, naming the first stage that will not fit; return the estimates otherwise."""
    refused = over_budget(fp32_bytes, stages, available, held, tied_table)
    if refused:
        raise refusal(refused)
    return stage_estimates(fp32_bytes, stages, held, tied_table)
