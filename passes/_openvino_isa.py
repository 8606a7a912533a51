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


#: Why a bf16 stage is not run without AMX (measured: docs/openvino.md, "Per CPU class").
SLOW_BF16 = "OpenVINO BF16 runs slower than FP32 on CPUs without AMX"


def bf16_skip_reason(target: CpuTarget | None = None) -> str | None:
    """bf16 pays with AMX's bf16 tiles: on MiniLM 2.8x faster than FP32 on an AMX CPU; on an AVX-512 BF16 CPU
    without AMX OpenVINO's bf16 was slower than FP32 (issue 13). Arm and unknown CPUs: not measured, run."""
    if target is None:
        from optpipe.hardware.cpu_features import engine_target

        target = engine_target("openvino")
    if target.arch != "x86_64" or target.source == "unknown" or target.has("amx_bf16"):
        return None
    seen = f"{target.cpu_class}, {target.restricted_by}" if target.restricted_by else target.cpu_class
    return f"{SLOW_BF16} (this CPU as OpenVINO runs it: {seen}); ov-fp32 stands in (skip_slow: false builds it anyway)"
