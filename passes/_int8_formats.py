"""Which int8 format ORT's integer kernels get, per CPU class (issue 17).

ORT's CPU int8 GEMMs (MLAS: MatMulInteger, QAttention, QLinearMatMul/Conv) multiply uint8
activations by the weights. Without VNNI, x86 does u8 x s8 with VPMADDUBSW, which adds two
products into a *saturating* int16: 255 x 127 x 2 = 64770 > 32767. ORT's quantization docs name the
two ways out, reduce_range (7-bit weights: 255 x 64 x 2 = 32640 fits) or U8U8 (another kernel, no
saturation). VNNI (VPDPBUSD, AVX-VNNI, AMX) accumulates into int32: full range is safe and best.

Optimum's presets (AutoQuantizationConfig, the reference) are u8 activations, symmetric
per-channel weights, and: arm64 s8 weights; avx2 u8 weights (U8U8); avx512 and avx512_vnni s8
weights, reduce_range off (its docs advise 7-bit weights on AVX-512 without VNNI). optpipe takes
u8s8 with VNNI and on Arm, and without VNNI (AVX2, AVX-512, SSE) u8s8 with reduce_range and a zero
point per weight channel. Measured on a real AVX2 EPYC (Zen 3, no AVX-512; MiniLM fused, QAttention,
2 threads, 16 interleaved rounds; docs/int8.md, "On a real AVX2 CPU"), token cosine mean / worst sentence:

    u8u8 (Optimum's avx2)              1.00x   0.9914 / 0.9750
    u8s8 full range (its avx512_vnni)  1.19x   0.9904 / 0.9778   saturates on other weights
    u8s8-reduce-range, symmetric       1.19x   0.9903 / 0.9654
    u8s8-reduce-range, asymmetric      1.19x   0.9908 / 0.9720   <- auto without VNNI

The zero points take back half of what the lost bit cost, and the kernel is u8s8's: 19% faster than
u8u8 at 0.0006 lower cosine, above both Optimum presets on that CPU. Full-range u8s8 saturates on
AVX2 (the tiny BERT of tests/test_ort_qattention.py falls to token cosine 0.978, worst 0.771,
natively and under `qemu-x86_64 -cpu Haswell`, against 0.9997 on VNNI), so it is only ever a
`format` to force. U8U8 stays a `format` for the last 0.0006.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
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
    # Asymmetric weights (a zero point per channel) spend the whole 7-bit range of reduce_range on each
    # channel's [min, max] instead of [-|max|, |max|]: on a real AVX2 EPYC (MiniLM, QAttention) they took
    # back half the accuracy reduce_range lost, at the same speed (MLAS applies the weights' zero points
    # outside its u8 x s8 kernel, so the int16 sums still fit). Dynamic only: ORT's static Q/DQ quantizer writes
    # symmetric int8 weights either way (ResNet-50, measured). Symmetric elsewhere, as Optimum's presets.
    weight_symmetric: bool = True

    def record(self) -> dict:
        return asdict(self)


def ort_format(requested: FormatName, cpu: CpuTarget, reduce_range: bool | None = None,
               weight_symmetric: bool | None = None, static: bool = False) -> Int8Format:
    """The format for ORT's CPU integer kernels: `requested`, or with `auto` the one for `cpu`'s class.
    `reduce_range` and `weight_symmetric` True/False override the format's own (None: as the format says)."""
    name, why = (requested, "asked for in the stage's params") if requested != "auto" else auto_choice(cpu)
    seven_bit = name == "u8s8-reduce-range"
    chosen = Int8Format(name, "uint8", "uint8" if name == "u8u8" else "int8", seven_bit, cpu.cpu_class, why,
                        weight_symmetric=static or not seven_bit)
    if reduce_range is not None and reduce_range != chosen.reduce_range:
        chosen = replace(chosen, reduce_range=reduce_range,
                         why=f"{chosen.why}; reduce_range {'on' if reduce_range else 'off'} as the params ask")
    if weight_symmetric is not None and weight_symmetric != chosen.weight_symmetric:
        chosen = replace(chosen, weight_symmetric=weight_symmetric,
                         why=f"{chosen.why}; {'symmetric' if weight_symmetric else 'asymmetric'} weights as the params ask")
    return chosen


#: ORT ops whose integer kernels take no weight zero point ("DynamicQuantizeLSTM : InputWeight zero point must be zero").
SYMMETRIC_WEIGHTS_ONLY = ("LSTM",)


def for_graph(chosen: Int8Format, quantized_ops: set[str], forced: bool | None) -> Int8Format:
    """`chosen`, with symmetric weights where the graph has an op to quantize whose kernel wants them."""
    strict = sorted(set(SYMMETRIC_WEIGHTS_ONLY) & quantized_ops)
    if chosen.weight_symmetric or not strict:
        return chosen
    if forced is False:
        raise ValueError(f"weight_symmetric false: ORT's int8 {', '.join(strict)} takes symmetric weights only; "
                         f"remove weight_symmetric or leave {', '.join(strict)} out of op_types")
    return replace(chosen, weight_symmetric=True, why=f"{chosen.why}; symmetric weights: ORT's int8 {', '.join(strict)} "
                   "takes no weight zero point")


def auto_choice(cpu: CpuTarget) -> tuple[str, str]:
    """(format, why) for a CPU class."""
    klass = cpu.cpu_class
    if klass in INT32_ACCUMULATING:
        return "u8s8", f"{klass}: VNNI dot products accumulate u8 x s8 into int32, full 8-bit range is exact (Optimum's avx512_vnni)"
    if cpu.arch == "arm64":
        return "u8s8", f"{klass}: NEON/dot-product kernels widen before adding, no saturation (Optimum's arm64)"
    if int8_sums_saturate(cpu):
        return "u8s8-reduce-range", (f"{klass}: without VNNI, u8 x s8 sums saturate int16 (VPMADDUBSW); 7-bit weights "
                                     "with a zero point per channel fit and keep the fast u8s8 kernel (ORT's advice; on a "
                                     "real AVX2 EPYC 1.19x u8u8's speed at 0.0006 lower cosine, above Optimum's presets)")
    return "u8s8", f"{klass}: ORT's default format (no int8 ISA facts for this architecture)"


def tensorrt_format(cpu: CpuTarget, reduce_range: bool | None) -> Int8Format:
    """TensorRT's explicit quantization takes symmetric s8 activations and weights, whatever this CPU."""
    why = "TensorRT's explicit quantization: symmetric int8 activations and weights"
    if int8_sums_saturate(cpu):
        # ORT CPU turns s8s8 Q/DQ into u8s8 integer kernels: on this class they saturate, so the CPU
        # figures of this form can be below what TensorRT will reach (TensorRT accumulates in int32).
        why += f"; on {cpu.cpu_class} ORT CPU may run it through saturating u8s8 kernels: its CPU accuracy is a lower bound"
    return Int8Format("s8s8", "int8", "int8", bool(reduce_range), cpu.cpu_class, why)
