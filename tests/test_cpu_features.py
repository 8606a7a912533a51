"""The CPU class (optpipe.hardware.cpu_features): detected here, injected for every other class, and
where it goes: the int8 format per class, the cache keys of ISA-dependent stages and evaluations,
report.json, the manifest and the latency rows (issue 17)."""
from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest

from helpers_passes import context, graph_recipe
from optpipe.core.errors import RecipeError
from optpipe.core.results import Latency
from optpipe.hardware.cpu_features import machine_id
from optpipe.execution.stage_runner import stage_key
from optpipe.hardware.cpu_features import CpuTarget, cpu_class, engine_target, machine_target, parse_features, restrict
from optpipe.passes._int8_formats import ort_format, tensorrt_format
from optpipe.passes.int8 import Int8Params, Int8Pass
from optpipe.passes.simplify import SimplifyParams, SimplifyPass
from optpipe.reporting.run_report import machine_description
from optpipe.safety.recipe_loading import parse_recipe

AMX = "avx2,fma,avx512f,avx512bw,avx512_vnni,avx512_bf16,avx512_fp16,avx_vnni,amx_tile,amx_int8,amx_bf16"
CLASSES = {
    "avx2 fma": "x86-avx2",  # Zen 2/3, Haswell..Skylake client
    "avx2,fma,avx_vnni": "x86-avx2-vnni",  # Alder Lake
    "avx2,fma,avx512f,avx512bw": "x86-avx512",  # Skylake-SP
    "avx2,fma,avx512f,avx512bw,avx512_vnni": "x86-avx512-vnni",  # Cascade Lake, Ice Lake, Zen 4
    AMX: "x86-amx",  # Sapphire Rapids
    "sse4_2": "x86-sse",
    "asimd": "arm64-neon",  # Cortex-A72 (Graviton 1)
    "asimd,asimddp": "arm64-dotprod",  # Neoverse N1 (Graviton 2, Ampere Altra)
    "arm64:asimd,asimddp,i8mm,sve,bf16": "arm64-i8mm",  # Neoverse V1 (Graviton 3)
}


def test_this_machine_has_a_class_read_from_its_kernel(monkeypatch):
    monkeypatch.delenv("OPTPIPE_CPU_FEATURES", raising=False)
    target = machine_target()
    assert target.cpu_class.split("-")[0] in ("x86", "arm64", platform.machine().lower())
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))
                 for f in line.split(":", 1)[1].split()}
        assert target.source == "/proc/cpuinfo" and target.features <= flags and target.features
        if "avx2" in flags and "avx512f" not in flags:
            assert target.cpu_class.startswith("x86-avx2")
        if "avx512_vnni" in flags:
            assert target.cpu_class in ("x86-avx512-vnni", "x86-amx")


@pytest.mark.parametrize("features, expected", list(CLASSES.items()))
def test_injected_features_name_their_class(monkeypatch, features, expected):
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", features)
    target = machine_target()
    assert target.cpu_class == expected and target.source == "OPTPIPE_CPU_FEATURES"
    assert target.arch == ("arm64" if expected.startswith("arm64") else "x86_64")


def test_flags_that_change_no_kernel_are_left_out_and_nothing_known_is_unknown():
    target = parse_features("avx2 fma sse4_2 aes popcnt")
    assert target.features == {"avx2", "fma"}
    assert cpu_class("x86_64", frozenset(), known=False) == "x86_64-unknown"
    assert CpuTarget("aarch64", frozenset(), "unknown").cpu_class == "arm64-unknown"


def test_onednn_max_cpu_isa_restricts_openvinos_class_not_orts(monkeypatch):
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert engine_target("onnxruntime").cpu_class == "x86-amx"  # MLAS does not read oneDNN's variable
    openvino = engine_target("openvino")
    assert openvino.cpu_class == "x86-avx2" and openvino.restricted_by == "ONEDNN_MAX_CPU_ISA=AVX2"
    full = machine_target()
    assert restrict(full, "avx512_core_vnni").cpu_class == "x86-avx512-vnni"  # oneDNN's names, any case
    assert restrict(full, "AVX512_CORE").cpu_class == "x86-avx512"
    assert restrict(full, "no-such-isa") == full  # oneDNN ignores a value it does not know
    assert restrict(parse_features("avx2,fma"), "AVX512_CORE_AMX").cpu_class == "x86-avx2"  # a cap, never more


@pytest.mark.parametrize("features, expected", [
    ("avx2 fma", ("u8s8-reduce-range", "int8", True, False)),
    ("avx2,fma,avx512f,avx512bw", ("u8s8-reduce-range", "int8", True, False)),
    ("sse4_2", ("u8s8-reduce-range", "int8", True, False)),
    ("avx2,fma,avx_vnni", ("u8s8", "int8", False, True)),
    ("avx2,fma,avx512f,avx512bw,avx512_vnni", ("u8s8", "int8", False, True)),
    (AMX, ("u8s8", "int8", False, True)),
    ("asimd,asimddp", ("u8s8", "int8", False, True)),
    ("arm64:asimd,asimddp,i8mm", ("u8s8", "int8", False, True)),
])
def test_auto_format_per_class_never_saturates(features, expected):
    chosen = ort_format("auto", parse_features(features))
    assert (chosen.name, chosen.weights, chosen.reduce_range, chosen.weight_symmetric) == expected
    assert chosen.activations == "uint8" and chosen.cpu_class in chosen.why


def test_a_forced_format_or_reduce_range_wins_and_says_so():
    avx2 = parse_features("avx2,fma")
    forced = ort_format("u8u8", avx2)
    assert (forced.name, forced.weights, forced.reduce_range) == ("u8u8", "uint8", False) and "params" in forced.why
    full = ort_format("auto", parse_features("avx2,fma,avx512f,avx512bw"), reduce_range=False)
    assert full.name == "u8s8-reduce-range" and not full.reduce_range and "reduce_range off" in full.why
    seven_bit = ort_format("u8u8", avx2, reduce_range=True)
    assert (seven_bit.name, seven_bit.reduce_range) == ("u8u8", True) and "reduce_range on" in seven_bit.why
    symmetric = ort_format("auto", avx2, weight_symmetric=True)
    assert (symmetric.name, symmetric.weight_symmetric) == ("u8s8-reduce-range", True) and "symmetric weights" in symmetric.why
    assert not ort_format("u8s8", avx2, weight_symmetric=False).weight_symmetric
    assert ort_format("auto", avx2, static=True).weight_symmetric  # static Q/DQ writes symmetric weights
    trt = tensorrt_format(avx2, None)
    assert (trt.name, trt.activations, trt.weights) == ("s8s8", "int8", "int8") and "lower bound" in trt.why
    assert "lower bound" not in tensorrt_format(parse_features(AMX), None).why


def test_format_is_refused_where_tensorrt_fixes_it():
    with pytest.raises(ValueError, match="target tensorrt always takes symmetric s8s8"):
        Int8Params(mode="static", target="tensorrt", format="u8u8")
    for target in ("tensorrt", "ort-cpu"):
        with pytest.raises(ValueError, match="weight_symmetric false is for mode dynamic"):
            Int8Params(mode="static", target=target, weight_symmetric=False)
    assert Int8Params(mode="dynamic", weight_symmetric=False).weight_symmetric is False
    assert Int8Params(mode="dynamic", format="u8u8").format == "u8u8"
    from optpipe.plan.validate import validate_recipe

    for params, says in (({"format": "s4s4"}, r"stages\.q\.params\.format"),
                         ({"mode": "static", "format": "u8s8"}, "target tensorrt always takes symmetric s8s8")):
        recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}],
                               "stages": {"export": {"pass": "export"}, "q": {"pass": "int8", "after": "export", "params": params}}})
        with pytest.raises(RecipeError, match=says):
            validate_recipe(recipe)


def _keys(monkeypatch, tmp_path, features: str) -> tuple[str, str, dict]:
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", features)
    recipe = graph_recipe([{"name": "x", "shape": ["N", 4]}], dims={"N": {"min": 1, "opt": 1, "max": 2}})
    ctx = context(recipe, tmp_path / features.replace(",", "_"), {"x": np.zeros((1, 4), np.float32)})
    return (stage_key(Int8Pass(Int8Params(mode="dynamic")), None, ctx),
            stage_key(SimplifyPass(SimplifyParams()), None, ctx), machine_id())


def test_the_class_joins_the_keys_of_isa_dependent_stages_and_of_evaluations_only(monkeypatch, tmp_path):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the suite may run under a cap
    int8_avx2, simplify_avx2, machine_avx2 = _keys(monkeypatch, tmp_path, "avx2,fma")
    int8_vnni, simplify_vnni, machine_vnni = _keys(monkeypatch, tmp_path, "avx2,fma,avx512f,avx512bw,avx512_vnni")
    assert int8_avx2 != int8_vnni  # a shared cache never hands AVX2 what VNNI decided
    assert simplify_avx2 == simplify_vnni  # a pass whose output is the same everywhere is shared across classes
    assert machine_avx2 != machine_vnni and machine_avx2["cpu_class"]["class"] == "x86-avx2"
    assert _keys(monkeypatch, tmp_path, "avx2,fma")[0] == int8_avx2  # and stable
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # changes OpenVINO's figures: its evaluation keys too
    assert machine_id()["openvino_cpu_class"] != machine_vnni["openvino_cpu_class"]


def test_report_manifest_and_rows_name_the_class(monkeypatch, tmp_path):
    from optpipe.core.results import StageResult
    from optpipe.reporting.rows import runtime_label
    from optpipe.targets.manifest import read_manifest, write_manifest

    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu = machine_description()["cpu"]
    assert (cpu["class"], cpu["openvino_class"], cpu["source"]) == ("x86-amx", "x86-avx2", "OPTPIPE_CPU_FEATURES")
    json.dumps(cpu)  # report.json holds it as is
    write_manifest(tmp_path, "r", [])
    assert read_manifest(tmp_path)["cpu"]["class"] == "x86-amx"
    latency = dict(batch_size=1, shape={"x": [1, 4]}, p50_ms=1, p90_ms=1, p99_ms=1, mean_ms=1, throughput=1, iterations=3)
    ov = Latency(**latency, provider="openvino-cpu", cpu_class="x86-avx2")
    ort = Latency(**latency, provider="CPUExecutionProvider", cpu_class="x86-amx")
    row = lambda lat: StageResult(name="s", pass_name="p", status="ok", latency=[lat])  # noqa: E731
    assert runtime_label(row(ov), cpu) == "openvino-cpu [x86-avx2]"  # timed on another class than the machine's: said
    assert runtime_label(row(ort), cpu) == "ort-cpu"


@pytest.mark.parametrize("features, saturates, bf16", [
    ("avx2,fma", True, False), ("avx2,fma,avx512f,avx512bw", True, False), ("sse4_2", True, False),
    ("avx2,fma,avx_vnni", False, False), ("avx2,fma,avx512f,avx512bw,avx512_vnni,avx512_bf16", False, True),
    (AMX, False, True), ("asimd,asimddp", False, False), ("arm64:asimd,asimddp,i8mm,bf16", False, True),
])
def test_the_int8_and_bf16_facts_part_b_reads(features, saturates, bf16):
    from optpipe.hardware.cpu_features import int8_sums_saturate, native_bf16

    target = parse_features(features)
    assert int8_sums_saturate(target) is saturates and native_bf16(target) is bf16


def test_openvino_bf16_is_refused_under_a_onednn_cap_below_it(monkeypatch):
    from optpipe.evaluation import openvino_runtime as ovr

    # OpenVINO itself is not started here: oneDNN reads ONEDNN_MAX_CPU_ISA once per process, so a cap
    # set by a test would hold every later test of the session to it.
    monkeypatch.setattr(ovr, "cpu_capabilities", lambda: ["BF16", "FP32", "INT8"])
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the suite may run under a cap
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    assert ovr.supports("bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not ovr.supports("bf16") and ovr.supports("int8") and ovr.supports("fp32")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert ovr.supports("bf16")
