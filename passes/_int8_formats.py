"""Which int8 format ORT's integer kernels get, per CPU class (issue 17).

ORT's CPU int8 GEMMs (MLAS: MatMulInteger, QAttention, QLinearMatMul/Conv) multiply uint8
activations by the weights. Without VNNI, x86 does u8 x s8 with VPMADDUBSW, which adds two
products into a *saturating* int16: 255 x 127 x 2 = 64770 > 32767. ORT's quantization docs name the
two ways out, reduce_range (7-bit weights: 255 x 64 x 2 = 32640 fits) or U8U8 (another kernel, no
saturation). VNNI (VPDPBUSD, AVX-VNNI, AMX) accumulates into int32: full range is safe and best.

Optimum's presets (AutoQuantizationConfig, the reference) are u8 activations, symmetric
per-channel weights, and: arm64 s8 weights; avx2 u8 weights (U8U8); avx512 and avx512_vnni s8
weights, reduce_range off (its docs advise 7-bit weights on AVX-512 without VNNI). optpipe follows
them: u8s8 with VNNI and on Arm, U8U8 on x86 without VNNI or AVX-512 (AVX2, SSE), u8s8 with
reduce_range on AVX-512 without VNNI. Measured on a real AVX2 EPYC (Zen 3, no AVX-512; MiniLM
fused, QAttention, 2 threads; docs/int8.md, "per CPU class"): U8U8 ran level with Optimum's avx2
preset (0.86-1.02x its speed over three runs) at token cosine 0.9914 vs 0.9906, u8s8-reduce-range 10% faster than U8U8 at 0.9903 (worst
sentence 0.965 vs 0.975): reduce_range loses a bit of every weight, U8U8 loses nothing. Full-range
u8s8 saturates on AVX2 (under `qemu-x86_64 -cpu Haswell` the tiny BERT of
tests/test_ort_qattention.py fell to token cosine 0.978, worst 0.771, against 0.9997 on VNNI), so
it is only ever a `format` to force.
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
    if int8_sums_saturate(cpu) and klass == "x86-avx512":
        return "u8s8-reduce-range", (f"{klass}: without VNNI, u8 x s8 sums saturate int16 (VPMADDUBSW); 7-bit weights "
                                     "fit (ORT's advice; Optimum's avx512 note) and keep the fast u8s8 kernel")
    if int8_sums_saturate(cpu):
        return "u8u8", (f"{klass}: without VNNI, u8 x s8 sums saturate int16 (VPMADDUBSW); u8 weights do not "
                        "(Optimum's avx2): level with its preset on a real AVX2 EPYC, more accurate than 7-bit weights")
    return "u8s8", f"{klass}: ORT's default format (no int8 ISA facts for this architecture)"


def tensorrt_format(cpu: CpuTarget, reduce_range: bool | None) -> Int8Format:
    """TensorRT's explicit quantization takes symmetric s8 activations and weights, whatever this CPU."""
    why = "TensorRT's explicit quantization: symmetric int8 activations and weights"
    if int8_sums_saturate(cpu):
        # ORT CPU turns s8s8 Q/DQ into u8s8 integer kernels: on this class they saturate, so the CPU
        # figures of this form can be below what TensorRT will reach (TensorRT accumulates in int32).
        why += f"; on {cpu.cpu_class} ORT CPU may run it through saturating u8s8 kernels: its CPU accuracy is a lower bound"
    return Int8Format("s8s8", "int8", "int8", bool(reduce_range), cpu.cpu_class, why)
