"""OpenVINO as a CPU engine: ONNX -> IR, compiled with the settings every stage is measured with.

The latency protocol matches ONNX Runtime's rows (optpipe.core.runtime): `threads` inference
threads, one stream and one infer request (`PERFORMANCE_HINT: LATENCY`), so the figures
are comparable row by row. The inference precision is pinned to f32 unless a stage asks
for bf16: on a CPU with bf16 instructions OpenVINO's default hint is bf16, a lossy precision an
fp32 or int8 stage did not ask for. What the plugin actually ran with is read back
from the compiled model and recorded, never assumed.

openvino is imported inside the functions: `import optpipe` must not pay for it.

No usage data leaves a compile: OpenVINO's converter and NNCF report to an analytics service through
openvino_telemetry unless told otherwise (`telemetry_off`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from optpipe.core.errors import first_line
from optpipe.core.runtime import Feeds, Outputs, prefill_feeds
from optpipe.hardware.cpu_features import ONEDNN_ENV, engine_target, native_bf16

IR_FILE = "model.xml"
WEIGHTS_FILE = "model.bin"
#: Beside the IR: the compile settings it was measured with (part of the stage's content hash).
SETTINGS_FILE = "openvino.json"
#: The runtime precisions a compiled layer reports (rt_info runtimePrecision), as the report names them;
#: i8 and u8 are int8 kernels.
PRECISION_NAMES = {"i8": "int8", "u8": "int8", "f32": "fp32", "f16": "fp16", "bf16": "bf16"}
INT8_PRECISIONS = tuple(p for p, name in PRECISION_NAMES.items() if name == "int8")
#: The label every OpenVINO measurement carries in Latency.provider (ORT's rows say CPUExecutionProvider).
PROVIDER = "openvino-cpu"
RUNTIME = "openvino"
#: Recipe precision -> OpenVINO's INFERENCE_PRECISION_HINT. An INT8 IR runs its FakeQuantize'd ops in
#: int8 and everything else at this hint: f32, for the reason in the module docstring.
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}


def stage_settings(artifact) -> tuple[Path, str, list[str] | None]:
    """(model file, precision hint, ONNX output names) to compile and run a stage with: an IR
    stage's own settings, or an ONNX stage read as is at f32."""
    folder = Path(artifact.folder)
    if not is_ir(folder):
        return folder / "model.onnx", "f32", output_names(folder / "model.onnx")
    settings = read_settings(folder)
    return folder / IR_FILE, settings.get("hint", "f32"), artifact.info.get("output_names")


def read_settings(folder: Path) -> dict[str, Any]:
    import json

    path = Path(folder) / SETTINGS_FILE
    return json.loads(path.read_text()) if path.is_file() else {"precision": "fp32", "hint": "f32"}


def write_settings(folder: Path, precision: str) -> dict[str, Any]:
    """Threads are not here: they belong to the evaluation (and the deployment), not to the model."""
    import json

    settings = {"format": 1, "precision": precision, "hint": PRECISION_HINTS[precision]}
    (Path(folder) / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
    return settings


def is_ir(folder: Path) -> bool:
    """A stage folder holding an OpenVINO IR (the `openvino` pass's output) rather than ONNX."""
    return (Path(folder) / IR_FILE).is_file()


#: openvino_telemetry declines to collect when the environment says it is a CI job (`disable_in_ci`,
#: which OpenVINO's converter and NNCF both pass); NNCF_CI is NNCF's own switch (its telemetry stub).
TELEMETRY_OFF = {"CI": "true", "NNCF_CI": "1"}
_telemetry_lock = threading.RLock()


@contextlib.contextmanager
def telemetry_off():
    """Around every call into OpenVINO or NNCF that starts their telemetry (`import openvino`, `convert_model`, `import nncf`).

    Without it each conversion wrote ~/intel/stats and ~/intel/openvino_ga_cid and started sender
    processes (11 per compile, measured) that reach for Google Analytics, and that printed their own
    tracebacks after a Ctrl-C. Their documented opt-out, `opt_in_out --opt_out`, writes a consent
    file in the user's home: optpipe writes nothing outside its output and cache folders, so it uses
    the library's other documented switch instead. Only around the calls: torch and transformers
    read CI too (torch makes some checks errors in CI), and a run must not change their behaviour."""
    with _telemetry_lock:
        saved = {name: os.environ.get(name) for name in TELEMETRY_OFF}
        os.environ.update(TELEMETRY_OFF)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def openvino():
    """The openvino package, imported with its telemetry off: `import openvino` itself sends an event."""
    with telemetry_off():
        import openvino

    return openvino


def nncf():
    """NNCF, imported with its telemetry off (it starts at import)."""
    with telemetry_off():
        import nncf

    return nncf


@lru_cache(maxsize=1)
def core():
    ov = openvino()

    core = ov.Core()
    view = engine_target("openvino")
    if view.restricted_by and not native_bf16(view):
        # The plugin picks its default precision from CPUID, not from ONEDNN_MAX_CPU_ISA: held to AVX2
        # on a BF16 machine it defaulted to bf16 and returned empty outputs. f32 is what a real
        # machine of the capped class defaults to, so the cap shows that machine's behaviour.
        core.set_property("CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return core


def cpu_capabilities() -> list[str]:
    """What OpenVINO's CPU plugin can run here, e.g. ['BF16', 'FP32', 'INT8', ...]."""
    return [str(c) for c in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def supports(precision: str) -> bool:
    """OpenVINO's own capabilities read CPUID and ignore ONEDNN_MAX_CPU_ISA: held below bf16 by it
    (to see an AVX2 machine's behaviour), a bf16 hint compiled, then output empty tensors (measured:
    shape (0, 32) for (32, 32) on the MLP of tests/test_openvino.py). No bf16 under such a cap."""
    if precision != "bf16":
        return True
    view = engine_target("openvino")
    return "BF16" in cpu_capabilities() and (view.restricted_by is None or native_bf16(view))


def read_model(path: Path):
    """An ov.Model from an IR (.xml + .bin) or an ONNX file (with its external data)."""
    return core().read_model(str(path))


def read_onnx(path: Path, mmap: bool = True):
    """ONNX -> ov.Model through OpenVINO's ONNX frontend with Core.read_model, which reads the external
    weights when they are used, rather than openvino.convert_model, which reads them all at once: on a
    1.47 GB decoder the model in memory took 0.08 GB instead of 2.8 GB, and NNCF's compression peaked at
    2.09 instead of 3.42 GB; the openvino pass's FP32 stage on BERT-base (438 MB) at 1.86 instead of 2.19 GB
    (measured; docs/memory.md).

    `mmap` (OpenVINO's ENABLE_MMAP): the weights are mapped from the file, else read into memory when
    used. Mapped, a page read once stays resident for as long as any weight of the file is alive, even
    after the weight read from it was replaced: a caller that replaces most weights (NNCF's compression)
    keeps less without the map (Gemma 3 270M's data-aware INT4 peaked 0.39 GB lower, its data-free INT4
    left 0.60 instead of 1.62 GB resident; docs/memory.md, seventh round)."""
    with telemetry_off():
        return core().read_model(str(path), config={"ENABLE_MMAP": mmap})


def convert_onnx(path: Path):
    """ONNX -> ov.Model, through the documented converter (openvino.convert_model)."""
    ov = openvino()

    with _root_logger_kept(), telemetry_off():
        return ov.convert_model(str(path))


@contextlib.contextmanager
def _root_logger_kept():
    """convert_model sets the root logger to ERROR (with its own filter and handler) and puts it
    back only when the conversion succeeds: after one failed conversion every later warning of
    the run (other stages', the report's) was dropped. Kept here with logging's public API."""
    root = logging.getLogger()
    level, filters, handlers = root.level, list(root.filters), list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        root.filters = filters
        root.handlers = handlers


def conversion_failure(exc: BaseException) -> str:
    """Why convert_model failed, in one line. Its message ends with a summary ("-- No conversion rule
    found for operations: Det-18"): that names the ops to replace, the lines above it do not. An op that has
    a rule but failed it ("-- AveragePool-20 with a message:") gets the message's last line, the cause
    ("Kernel after dilation has size (dim: 2560) larger than the data shape after padding (dim: 2)"): the
    summary alone said "AveragePool-20 with a message:; Conversion is failed for: AveragePool-20"."""
    from optpipe.core.errors import first_line

    lines = [line.strip() for line in str(exc).splitlines()]
    summary = [line[2:].strip() for line in lines if line.startswith("--")]
    if not summary:
        return first_line(exc)
    failed = next((i for i, line in enumerate(lines) if line.startswith("--") and line.endswith("with a message:")), None)
    if failed is not None:
        block = lines[failed + 1:lines.index("Summary:", failed) if "Summary:" in lines[failed:] else None]
        cause = next((line for line in reversed(block) if line), "")
        return f"{summary[0].removesuffix(' with a message:')}: {cause}"[:300]
    return "; ".join(summary)[:300]


def save_ir(model, folder: Path) -> Path:
    """Write model.xml + model.bin; weights stay FP32 (no FP16 compression: that is a precision change)."""
    ov = openvino()

    folder.mkdir(parents=True, exist_ok=True)
    target = folder / IR_FILE
    ov.save_model(model, str(target), compress_to_fp16=False)
    return target


def compile_config(threads: int, hint: str = "f32") -> dict[str, Any]:
    """The measured settings: one latency stream on `threads` threads at the given precision hint."""
    return {
        "INFERENCE_NUM_THREADS": int(threads),
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "INFERENCE_PRECISION_HINT": hint,
    }


def compile_model(model_or_path, threads: int, hint: str = "f32"):
    """A compiled CPU model (from an ov.Model or a path to .xml/.onnx) with `compile_config`."""
    source = str(model_or_path) if isinstance(model_or_path, Path) else model_or_path
    with _restriction_blamed():
        return core().compile_model(source, "CPU", compile_config(threads, hint))


@contextlib.contextmanager
def _restriction_blamed():
    """Around an OpenVINO call: a oneDNN refusal under ONEDNN_MAX_CPU_ISA becomes _blamed_on_restriction's line."""
    try:
        yield
    except RuntimeError as exc:
        blamed = _blamed_on_restriction(exc)
        if blamed is exc:
            raise
        raise blamed from exc


def _blamed_on_restriction(exc: RuntimeError) -> RuntimeError:
    """oneDNN refusing a layer while ONEDNN_MAX_CPU_ISA holds it below this CPU: the restriction's fault.

    Measured (OpenVINO 2026.4): NNCF-compressed weights (FullyConnectedCompressed) fail to build, at
    compile or at the first inference of dynamic shapes, under ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512
    host, and with some configurations run with empty outputs; the same IR runs on an emulated AVX2
    CPU (qemu-x86_64 -cpu Haswell). So the line says what to unset, not that the model is broken."""
    restricted = engine_target("openvino").restricted_by
    if not restricted or "could not create a primitive descriptor" not in str(exc):
        return exc
    return RuntimeError(f"OpenVINO cannot build a layer of this model under {restricted} on this CPU "
                        f"({first_line(exc)[:110]}); unset {ONEDNN_ENV} to run it at this CPU's own ISA "
                        "(a real CPU of that class runs it)")


def default_inference_precision() -> str:
    """The precision the CPU plugin runs float ops at when nothing pins it (bf16 where the CPU has BF16)."""
    return _precision_name(core().get_property("CPU", "INFERENCE_PRECISION_HINT"))


def _precision_name(hint) -> str:
    name = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}.get(name, name)


def inference_precision(compiled) -> str:
    """The precision the plugin runs float ops at (bf16 / f32 / f16), as it reports it."""
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")
    return hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)


#: Layer types (the CPU plugin's names) that do the arithmetic INT8 is for.
COMPUTE_LAYERS = ("FullyConnected", "MatMul", "Convolution", "Deconvolution")


def runtime_precisions(compiled, layer_types: tuple[str, ...] | None = None) -> dict[str, int]:
    """How many executed layers (of `layer_types`, default all) run at each precision, from the
    compiled model's runtime graph (rt_info `runtimePrecision`)."""
    counts: Counter[str] = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "runtimePrecision" not in info:
            continue
        kind = _text(info["layerType"])
        if kind in ("Input", "Output", "Const") or (layer_types is not None and kind not in layer_types):
            continue
        counts[_text(info["runtimePrecision"])] += 1
    return dict(sorted(counts.items()))


def _text(value) -> str:
    """An rt_info value (OVAny) as text."""
    return value.astype(str) if hasattr(value, "astype") else str(value)


def precision_facts(compiled) -> dict[str, Any]:
    """What the stage info and report record about a compiled model's precision: the hint the
    plugin runs float ops at, and the compute layers (MatMul, Conv, ...) per runtime precision:
    the evidence that an INT8 model really runs int8 kernels (an FP32 model runs a few mask
    and index layers in u8: those are not counted)."""
    compute = runtime_precisions(compiled, COMPUTE_LAYERS)
    return {
        "inference_precision": inference_precision(compiled),
        "compute_layer_precisions": compute,
        "int8_layers": sum(n for p, n in compute.items() if p in INT8_PRECISIONS),
    }


def input_shapes(model) -> list[tuple[str, list]]:
    """(name, shape) of a model's or compiled model's inputs, None for a dynamic dim (what prefill_feeds takes)."""
    return [(port.get_any_name(), [d.get_length() if d.is_static else None for d in port.get_partial_shape()])
            for port in model.inputs]


def runner(compiled, output_names: list[str] | None = None) -> Callable[[Feeds], Outputs]:
    """run(feeds) -> {output name: array} through one infer request (the latency protocol).

    Outputs are named as in the ONNX graph the IR came from (`output_names`: an output
    tensor can carry several names after conversion; the ONNX one is the one compared),
    and copied: the request reuses its output buffers on the next call.
    """
    request = compiled.create_infer_request()
    inputs = {port.get_any_name() for port in compiled.inputs}
    ports = [(pick_name(port, output_names), port) for port in compiled.outputs]
    shapes = input_shapes(compiled)

    def run(feeds: Feeds) -> Outputs:
        feeds = prefill_feeds(feeds, shapes)  # a KV-cache decoder's one forward is its prefill
        with _restriction_blamed():
            request.infer({k: v for k, v in feeds.items() if k in inputs})
        outputs = {name: np.array(request.get_tensor(port).data, copy=True) for name, port in ports}
        check_not_emptied(outputs, feeds)
        return outputs

    return run


def check_not_emptied(outputs: Outputs, feeds: Feeds) -> None:
    """Every output empty from non-empty inputs while ONEDNN_MAX_CPU_ISA restricts oneDNN: what
    NNCF-compressed weights return under ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 host (measured,
    OpenVINO 2026.4), which later failed as a bare IndexError. One line naming the variable instead."""
    restricted = engine_target("openvino").restricted_by
    if not restricted or not outputs or any(o.size for o in outputs.values()):
        return
    if all(np.asarray(v).size for v in feeds.values()):
        raise RuntimeError(f"OpenVINO returned empty outputs for non-empty inputs under {restricted} on this CPU "
                           f"(seen with compressed weights); unset {ONEDNN_ENV} to run it at this CPU's own ISA")


def pick_name(port, wanted: list[str] | None) -> str:
    names = port.get_names()
    for name in wanted or []:
        if name in names:
            return name
    return port.get_any_name()


def output_names(path: Path) -> list[str]:
    """Output names of an ONNX file (the names the reference stage's outputs carry)."""
    import onnx

    return [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
