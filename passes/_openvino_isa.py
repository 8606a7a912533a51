"""Whether OpenVINO INT8 can pay on this CPU, as OpenVINO's CPU plugin will run it.

OpenVINO's INT8 kernels (oneDNN's) multiply int8 with VNNI's dot-product instructions
(AVX-512 VNNI, AVX-VNNI, AMX). Without them the int8 GEMMs fall back to 16-bit multiply-adds:
at AVX-512 width that still paid (MiniLM INT8 1.6x faster than FP32 with oneDNN held to
AVX512_CORE), at AVX2 width it did not: OpenVINO INT8 ran slower than OpenVINO FP32, 35 vs 27 ms on
an AVX2-only EPYC (issue 17) and 77 vs 72 ms on a Sapphire Rapids held to AVX2 (docs/openvino.md,
"Per CPU class"). So int8 is skipped on the AVX2 class without VNNI only.
OpenVINO's own OPTIMIZATION_CAPABILITIES lists INT8 on every x86 CPU (it runs there, it does
not pay), so it cannot tell; the CPU's features, as oneDNN sees them, can
(optpipe.hardware.cpu_features.engine_target("openvino"): ONEDNN_MAX_CPU_ISA included).
Arm and unknown CPUs take the branch that runs the stage: nothing was measured there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optpipe.hardware.cpu_features import CpuTarget

#: Why an int8 stage is not run on the AVX2 class (measured: docs/openvino.md, "Per CPU class").
SLOW_INT8 = "OpenVINO INT8 runs slower than FP32 on CPUs without VNNI or AVX-512 (AVX2 class)"
#: Features whose presence makes OpenVINO INT8 pay (measured faster than its FP32 on MiniLM).
INT8_PAYS = ("avx512_vnni", "avx_vnni", "amx_int8", "avx512f")


def int8_skip_reason(target: CpuTarget | None = None) -> str | None:
    """The one line an int8 stage is skipped with on `target` (default: this CPU as OpenVINO sees it),
    or None where int8 can pay."""
    if target is None:
        from optpipe.hardware.cpu_features import engine_target

        target = engine_target("openvino")
    if target.arch != "x86_64" or target.source == "unknown" or any(target.has(f) for f in INT8_PAYS):
        return None
    seen = f"{target.cpu_class}, {target.restricted_by}" if target.restricted_by else target.cpu_class
    return f"{SLOW_INT8} (this CPU as OpenVINO runs it: {seen}); ov-fp32 and ONNX Runtime's candidates stand in " \
           "(skip_slow: false builds it anyway)"


#: Why a bf16 stage is not run without bf16 instructions (measured: docs/openvino.md, "Per CPU class").
NO_BF16 = "OpenVINO BF16 pays only with bf16 instructions (AVX-512 BF16 or AMX), which this CPU lacks"


def bf16_skip_reason(target: CpuTarget | None = None) -> str | None:
    """bf16 pays where the CPU multiplies bf16 itself (AVX-512 BF16's dot products, AMX's tiles): measured
    against FP32 on MiniLM 2.6x with AMX (Sapphire Rapids) and 1.78x without it (Zen 4, AVX-512 BF16), and on
    ResNet-50 1.93x on that Zen 4, at cosine >= 0.99999. Without those instructions oneDNN has no bf16
    kernels to run (OpenVINO lists no BF16 there). Arm and unknown CPUs: not measured, run."""
    from optpipe.hardware.cpu_features import native_bf16

    if target is None:
        from optpipe.hardware.cpu_features import engine_target

        target = engine_target("openvino")
    if target.arch != "x86_64" or target.source == "unknown" or native_bf16(target):
        return None
    seen = f"{target.cpu_class}, {target.restricted_by}" if target.restricted_by else target.cpu_class
    return f"{NO_BF16} (this CPU as OpenVINO runs it: {seen}); ov-fp32 stands in (skip_slow: false builds it anyway)"


#: Why a transformer's int8 takes NNCF's performance preset on AMX (measured: docs/openvino.md, "Per CPU class").
AMX_SYMMETRIC = ("symmetric int8 activations (NNCF preset performance): AMX multiplies signed int8 by signed int8 "
                 "natively, and NNCF's mixed preset's asymmetric activations ran slower there")


def int8_preset(transformer: bool, target: CpuTarget | None = None) -> tuple[str, str] | None:
    """(NNCF preset, why) where this CPU class changes NNCF's default preset; None where NNCF's default stands.

    NNCF's default for its TRANSFORMER model type is `mixed` (asymmetric activations, as unsigned int8); for other
    models `performance` (symmetric). Measured on MiniLM (bench/openvino_minilm.py, 16 rounds, one Sapphire Rapids
    class VM, 2026-12-06): with AMX `performance` ran 8-9% faster than `mixed` at batch 1 and 5% at batch 8, at
    token cosine 0.9959 vs 0.9961 (worst sentence 0.9915 vs 0.9924); on the same CPU held to AVX512_CORE_VNNI,
    whose dot product is unsigned x signed (VPDPBUSD), `performance` was 5% slower at both. So only AMX changes it."""
    if target is None:
        from optpipe.hardware.cpu_features import engine_target

        target = engine_target("openvino")
    if transformer and target.arch == "x86_64" and target.has("amx_int8"):
        return "performance", AMX_SYMMETRIC
    return None
