"""The peers' own results for bench/run.py: Hugging Face Optimum (its preset for this CPU, and its avx512_vnni one),
Microsoft Olive and plain NNCF, run by their documented commands.

They are not optimpipe dependencies: install them into a scratch virtual environment of their own
(their pins differ from optpipe's) and point PEERS_BIN at its bin folder, e.g.

    python3.11 -m venv /tmp/peers
    printf '%s\n' torch==2.13.0 transformers==4.57.6 optimum==2.1.0 optimum-onnx==0.1.0 \
        onnxruntime==1.32.0 onnx==1.23.2 sympy==1.14.0 olive-ai==0.13.0 >/tmp/peers/constraints.txt
    /tmp/peers/bin/pip install -c /tmp/peers/constraints.txt "optimum[onnxruntime]" olive-ai
    PEERS_BIN=/tmp/peers/bin python bench/run.py recipes/minilm.yaml

The pins are the set every peer row of docs/benchmarks.md was made with (2026-12-02): torch 2.13.0 is
the CPU build optpipe uses; transformers 4.57.6 is the newest optimum-onnx 0.1.0 takes (its export
differs from optpipe's transformers 5); the rest is what pip resolved then. With them the Optimum
path below runs end to end (its preprocess step included: an earlier session's venv, of unrecorded
versions, failed there with a TypeError in symbolic shape inference; a clean venv with these pins
does not). A different set may change the peers' graphs: pin it again and say so beside the figures.

Each peer runs with Hugging Face Hub access off (HF_HUB_OFFLINE) and writes into a scratch folder
outside the repository (PEERS_DIR, default /tmp/optpipe-peers/<model>); bench/run.py then times the ONNX file it produced in its own
process, beside optpipe's stages, on the same ONNX Runtime, inputs and threads. Only
Hugging Face folder models (`model: {hf: ...}` or `{package: ...}`) have peer rows.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

PEER_TIMEOUT_S = 1200


class PeerUnavailable(Exception):
    """The peer's tool is not installed, or the model is not one it takes: one line in the benchmark."""


def peer_models(recipe) -> dict[str, tuple[str, Path | str]]:
    """name -> (what, ONNX path, or the reason there is none): each peer's documented recipe for this model."""
    from optpipe.source.model_source import hf_folder
    from optpipe.recipe.schema import HFModel

    if not isinstance(recipe.model, HFModel):
        return {"peers": ("Optimum, Olive", "not run: they take Hugging Face model folders with weights")}
    folder = hf_folder(recipe.model_source())
    scratch = Path(os.environ.get("PEERS_DIR", "/tmp/optpipe-peers")) / recipe.name
    preset = optimum_preset()
    builds = [(f"optimum:int8-{preset}-per-channel", f"Optimum -O2, ORT quantization preprocess (shapes only), then quantize --{preset} "
               "--per_channel (Optimum's preset for this CPU)", lambda f, out: _optimum(f, out, preset))]
    if preset != "avx512_vnni":
        builds.append(("optimum:int8-avx512_vnni-per-channel", "the same with Optimum's --avx512_vnni preset (the one its docs measured)",
                       lambda f, out: _optimum(f, out, "avx512_vnni")))
    builds += [("olive:int8-dynamic", "Olive OnnxConversion + OnnxDynamicQuantization", lambda f, out: _olive(f, out)),
               ("nncf:int8-defaults", "plain NNCF: openvino.convert_model of the export, nncf.quantize(model_type=TRANSFORMER), "
                "else its defaults, on the recipe's calibration set; OpenVINO runtime", lambda f, out: _nncf(recipe, out))]
    results = {}
    for name, what, build in builds:
        try:
            results[name] = (what, build(folder, scratch / name.replace(":", "-")))
        except PeerUnavailable as exc:
            results[name] = (what, f"not run: {exc}")
    return results


def optimum_preset() -> str:
    """Optimum's quantization preset for the CPU ONNX Runtime runs on here (`optimum-cli onnxruntime quantize
    --arm64 | --avx2 | --avx512 | --avx512_vnni`): ORT's MLAS picks kernels by the CPU's own ISA (ONEDNN_MAX_CPU_ISA
    holds only OpenVINO back), so the preset follows the machine's features (OPTPIPE_CPU_FEATURES injects them)."""
    from optpipe.hardware.cpu_features import machine_target

    cpu = machine_target()
    if cpu.arch == "arm64":
        return "arm64"
    if cpu.has("avx512_vnni") or cpu.has("amx_int8"):
        return "avx512_vnni"
    return "avx512" if cpu.has("avx512f") else "avx2"


def _nncf(recipe, out: Path) -> Path:
    """NNCF's defaults, done by hand as its docs show: convert, `nncf.quantize(model, nncf.Dataset(samples))`, save.
    Quantized again per ONEDNN_MAX_CPU_ISA (NNCF collects statistics by running the model on OpenVINO)."""
    out = out.with_name(out.name + "-transformer-" + (os.environ.get("ONEDNN_MAX_CPU_ISA") or "native").lower())
    final = out / "model.xml"
    if final.is_file():
        return final
    try:
        from optpipe.evaluation import openvino_runtime as ovr

        nncf, ov = ovr.nncf(), ovr.openvino()  # imported with their telemetry off, as the openvino pass does
    except ImportError as exc:
        raise PeerUnavailable(f"nncf/openvino not importable ({exc})") from None
    from optpipe.cache.store import StageCache, default_cache_dir
    from optpipe.calibration.dataset import build_sample_set

    run_dir = recipe.resolve(recipe.output)
    exported = run_dir / "stages" / "export" / "model.onnx"
    if not exported.is_file() or recipe.data.calibration is None:
        raise PeerUnavailable("needs the run's export stage and the recipe's data.calibration")
    cache = StageCache(recipe.resolve(recipe.cache) if recipe.cache else default_cache_dir())
    samples = build_sample_set(recipe.data.calibration, recipe.model_source(), cache.root)
    with ovr.telemetry_off():
        model = ov.convert_model(str(exported))
    names = {port.get_any_name() for port in model.inputs}
    items = [{k: v for k, v in batch.items() if k in names} for batch in samples.batches(1)]
    # NNCF's documented call for a transformer (its docs' BERT example): model_type TRANSFORMER, else its defaults.
    quantized = nncf.quantize(model, nncf.Dataset(items), model_type=nncf.ModelType.TRANSFORMER)
    out.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(final), compress_to_fp16=False)
    return final


def _tool(name: str) -> str:
    bin_dir = os.environ.get("PEERS_BIN")
    path = shutil.which(name, path=bin_dir) if bin_dir else shutil.which(name)
    if path is None:
        raise PeerUnavailable(f"`{name}` not found (install the peers into a scratch venv and set PEERS_BIN; see bench/peers.py)")
    return path


def _run(command: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        # Nothing from a model hub: the peers read the local model folder only (a hub call would fail, not fetch).
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=PEER_TIMEOUT_S, env=offline_env())
    if done.returncode != 0:
        raise PeerUnavailable(f"`{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(command))}` failed "
                              f"(exit {done.returncode}, log {log})")


def offline_env() -> dict[str, str]:
    """The peers' environment with Hugging Face Hub access off (transformers, optimum, huggingface_hub, Olive)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _optimum(model: Path, out: Path, preset: str = "avx512_vnni") -> Path:
    """Optimum's documented CPU path: export, `optimum-cli onnxruntime optimize -O2`, then dynamic int8 for VNNI
    (`quantize --avx512_vnni --per_channel`: QOperator, IntegerOps, per-channel symmetric int8 weights, uint8
    activations, no reduce_range; MatMul, Attention, Gather, EmbedLayerNormalization and others).

    Between the two, ONNX Runtime's own documented pre-processing for quantization
    (`python -m onnxruntime.quantization.preprocess`, shape inference only: `--skip_optimization True --auto_merge`, so
    Optimum's graph is not changed). Without it, Optimum 2.1 (optimum-onnx 0.1) with onnxruntime 1.31 and
    1.32 (and, by their source, every release since 1.17) stops on the -O2 graph with "Unable to find data type for weight_name=...MatMul_output_0": its
    fused com.microsoft ops carry no output types (Optimum's export with torch 2.13 carries no value_info) and Optimum
    has no way to pass the quantizer's `DefaultTensorType` option (huggingface/optimum#2186, #1959).
    Symbolic shape inference, which knows the com.microsoft ops, writes those types; every op, weight and
    quantization setting stays Optimum's own."""
    final = out / "quantized" / "model_optimized_quantized.onnx"
    if final.is_file():
        return final
    cli = _tool("optimum-cli")
    shutil.rmtree(out / "quantized", ignore_errors=True)
    _run([cli, "export", "onnx", "--model", str(model), "--task", "feature-extraction", str(out / "export")], out / "export.log")
    _run([cli, "onnxruntime", "optimize", "--onnx_model", str(out / "export"), "-O2", "-o", str(out / "O2")], out / "optimize.log")
    shaped = out / "O2-shapes"
    python = _tool("python")  # the peers venv's, with the onnxruntime Optimum runs on
    shutil.rmtree(shaped, ignore_errors=True)
    shutil.copytree(out / "O2", shaped, ignore=shutil.ignore_patterns("*.onnx", "*.onnx_data", "*.data"))
    _run([python, "-m", "onnxruntime.quantization.preprocess", "--input", str(out / "O2" / "model_optimized.onnx"),
          "--output", str(shaped / "model_optimized.onnx"), "--skip_optimization", "True", "--auto_merge"], out / "preprocess.log")
    _run([cli, "onnxruntime", "quantize", "--onnx_model", str(shaped), f"--{preset}", "--per_channel",
          "-o", str(out / "quantized")], out / "quantize.log")
    found = sorted((out / "quantized").glob("*.onnx"))
    if not found:
        raise PeerUnavailable(f"Optimum wrote no ONNX file into {out / 'quantized'}")
    return found[0]


def _olive(model: Path, out: Path) -> Path:
    """Olive's documented workflow run (`olive run --config`): TorchScript ONNX conversion, then dynamic quantization."""
    found = sorted((out / "output").rglob("*.onnx"))
    if found:
        return found[0]
    cli = _tool("olive")
    config = {
        "input_model": {"type": "HfModel", "model_path": str(model), "task": "feature-extraction"},
        "systems": {"local_system": {"type": "LocalSystem", "accelerators": [{"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
        "passes": {"conversion": {"type": "OnnxConversion", "target_opset": 17},
                   "quantization": {"type": "OnnxDynamicQuantization"}},
        "host": "local_system", "target": "local_system",
        "cache_dir": str(out / "cache"), "output_dir": str(out / "output"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "olive.json").write_text(json.dumps(config, indent=1))
    _run([cli, "run", "--config", str(out / "olive.json")], out / "olive.log")
    found = sorted((out / "output").rglob("*.onnx"))
    if not found:
        raise PeerUnavailable(f"Olive wrote no ONNX file under {out / 'output'}")
    return found[0]
