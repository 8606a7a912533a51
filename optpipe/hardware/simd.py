"""The vector width that channel counts should be a multiple of, per target.

A pruned Conv whose channel count is not a multiple of the CPU's fp32 SIMD lanes leaves a
remainder loop in every kernel: issue 12 measured YOLOv5s 1.66x slower than unpruned with
round_to 8 and 1.15x faster with 16 on an AVX-512 CPU. Measured here (AMD EPYC, AVX-512, ORT 1.31,
2 threads, 6 interleaved rounds, load 1.8): 25% structured pruning of YOLOv5s at 640 px ran 1.30x
(round_to 8) and 1.28x (round_to 16) faster than unpruned, so this CPU does not show the effect;
the width is read from the CPU's flags rather than timed at compile time, where a shared
machine's noise is larger than the effect, and a prune slower than its parent warns in the report.
"""
from __future__ import annotations

from optpipe.hardware.cpu_features import machine_target

# TensorRT's tensor cores want channel counts that are multiples of 8 (FP16) and 16/32 (INT8).
TENSORRT_ALIGNMENT = 16


def cpu_fp32_lanes() -> int:
    """fp32 lanes of the widest vector unit: 16 (AVX-512), 8 (AVX2), 4 (SSE, NEON, unknown). From
    cpu_features, so OPTPIPE_CPU_FEATURES holds here as for every other per-CPU choice."""
    target = machine_target()
    if target.has("avx512f"):
        return 16
    return 8 if target.has("avx2") else 4


def channel_multiple(target_kinds: list[str]) -> int:
    """What pruned channel counts are rounded to for the recipe's targets (CPU unless TensorRT is one)."""
    lanes = cpu_fp32_lanes()
    return max(lanes, TENSORRT_ALIGNMENT) if "tensorrt" in target_kinds else lanes
