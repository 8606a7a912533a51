"""Which int8 format ORT's integer kernels get, per CPU class (issue 17).

ORT's CPU int8 GEMMs (MLAS: MatMulInteger, QAttention, QLinearMatMul/Conv) multiply uint8
activations by the weights. Without VNNI, x86 does u8 x s8 with VPMADDUBSW, which adds two
products into a *saturating* int16: 255 x 127 x 2 = 64770 > 32767. ORT's quantization docs name the
two ways out, reduce_range (7-bit weights: 255 x 64 x 2 = 32640 fits) or U8U8 (another kernel, no
saturation). VNNI (VPDPBUSD, AVX-VNNI, AMX) accumulates into int32: full range is safe and best.

Optimum's presets (AutoQuantizationConfig, the reference) are u8 activations, symmetric
per-channel weights, and: arm64 s8 weights; avx2 u8 weights (U8U8); avx512 and avx512_vnni s8
weights, reduce_range off (its docs advise 7-bit weights on AVX-512 without VNNI). optpipe follows
them except on x86 without VNNI, where it takes u8s8 with reduce_range, not U8U8: measured on
the tiny BERT of tests/test_ort_qattention.py under `qemu-x86_64 -cpu Haswell` (MLAS's AVX2
kernels), full-range u8s8 fell to token cosine 0.978 (worst 0.771) against 0.9997 natively on
VNNI; reduce_range gave 0.99931 / 0.99648 and U8U8 0.99960 / 0.99676, both the same as on VNNI;
reduce_range keeps the u8s8 kernel, which does twice U8U8's multiplies per instruction (VPMADDUBSW
on bytes vs VPMADDWD on words). U8U8 stays a `format` to force. docs/int8.md, "per CPU class".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from optpipe.hardware.cpu_features import INT32_ACCUMULATING, CpuTarget, int8_sums_saturate

FormatName = Literal["auto", "u8s8", "u8s8-reduce-range", "u8u8"]


@dataclass(frozen=True)
class Int8Format:
    name: str  # u8s8, u8s8-reduce-range, u8u8, s8s8 (TensorRT's)
    activations: Literal["uint8", "int8"]
    weights: Literal["uint8", "int8"]
    reduce_range: bool
    cpu_class: str
    why: str

    def record(self) -> dict:
        return asdict(self)


def ort_format(requested: FormatName, cpu: CpuTarget, reduce_range: bool | None = None) -> Int8Format:
    """The format for ORT's CPU integer kernels: `requested`, or with `auto` the one for `cpu`'s class.
    `reduce_range` True/False overrides the format's own (None: as the format says)."""
    name, why = (requested, "asked for in the stage's params") if requested != "auto" else auto_choice(cpu)
    chosen = Int8Format(name, "uint8", "uint8" if name == "u8u8" else "int8", name == "u8s8-reduce-range", cpu.cpu_class, why)
    if reduce_range is not None and reduce_range != chosen.reduce_range:
        chosen = Int8Format(chosen.name, chosen.activations, chosen.weights, reduce_range, chosen.cpu_class,
                            f"{chosen.why}; reduce_range {'on' if reduce_range else 'off'} as the params ask")
    return chosen


def auto_choice(cpu: CpuTarget) -> tuple[str, str]:
    """(format, why) for a CPU class."""
    klass = cpu.cpu_class
    if klass in INT32_ACCUMULATING:
        return "u8s8", f"{klass}: VNNI dot products accumulate u8 x s8 into int32, full 8-bit range is exact (Optimum's avx512_vnni)"
    if cpu.arch == "arm64":
        return "u8s8", f"{klass}: NEON/dot-product kernels widen before adding, no saturation (Optimum's arm64)"
    if int8_sums_saturate(cpu):
        return "u8s8-reduce-range", (f"{klass}: without VNNI, u8 x s8 sums saturate int16 (VPMADDUBSW); 7-bit weights "
                                     "fit (ORT's advice; Optimum's avx512 note) and keep the fast u8s8 kernel")
    return "u8s8", f"{klass}: ORT's default format (no int8 ISA facts for this architecture)"


def tensorrt_format(cpu: CpuTarget, reduce_range: bool | None) -> Int8Format:
    """TensorRT's explicit quantization takes symmetric s8 activations and weights, whatever this CPU."""
    why = "TensorRT's explicit quantization: symmetric int8 activations and weights"
    if int8_sums_saturate(cpu):
        # ORT CPU turns s8s8 Q/DQ into u8s8 integer kernels: on this class they saturate, so the CPU
        # figures of this form can be below what TensorRT will reach (TensorRT accumulates in int32).
        why += f"; on {cpu.cpu_class} ORT CPU may run it through saturating u8s8 kernels: its CPU accuracy is a lower bound"
    return Int8Format("s8s8", "int8", "int8", bool(reduce_range), cpu.cpu_class, why)
