"""Which OpenVINO precisions can pay on this CPU, as OpenVINO's CPU plugin will run them.

OpenVINO's INT8 kernels (oneDNN's) multiply int8 with VNNI's dot-product instructions
(AVX-512 VNNI, AVX-VNNI, AMX). Without them the int8 GEMMs fall back to 16-bit multiply-adds:
at AVX-512 width that still paid (MiniLM INT8 1.6x faster than FP32 with oneDNN held to
AVX512_CORE), at AVX2 width it did not: OpenVINO INT8 ran slower than OpenVINO FP32, 35 vs 27 ms on
an AVX2-only EPYC (issue 17) and 77 vs 72 ms on this Sapphire Rapids held to AVX2 (docs/openvino.md,
"Per CPU class"). So int8 is skipped on the AVX2 class without VNNI only.
OpenVINO's own OPTIMIZATION_CAPABILITIES lists INT8 on every x86 CPU (it runs there, it does
not pay), so it cannot tell; the CPU's features can.

oneDNN honours ONEDNN_MAX_CPU_ISA: a process that holds OpenVINO to AVX2 runs AVX2 kernels on a
VNNI CPU, so the ISA OpenVINO runs with is the CPU's features capped by that variable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: ONEDNN_MAX_CPU_ISA values (oneDNN's names, upper case) under which oneDNN still uses VNNI
#: (int8 dot products). AVX512_CORE is wider than AVX2_VNNI yet has no VNNI: it is not here.
VNNI_CAPS = frozenset({"AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16",
                       "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT"})
#: ... and those that keep AVX-512 (every AVX512_* name).
AVX512_CAPS = frozenset({c for c in VNNI_CAPS if c.startswith("AVX512")} | {"AVX512_CORE", "ALL", "DEFAULT"})
#: Why an int8 stage is not run on the AVX2 class (measured: docs/openvino.md, "Per CPU class").
SLOW_INT8 = "OpenVINO INT8 runs slower than FP32 on CPUs without VNNI or AVX-512 (AVX2 class)"


@dataclass(frozen=True)
class OpenVinoIsa:
    """The CPU class OpenVINO's kernels run at here: the CPU's own, or what ONEDNN_MAX_CPU_ISA caps it to."""

    cpu_class: str
    vnni: bool
    avx512: bool
    cap: str | None

    @property
    def label(self) -> str:
        return f"{self.cpu_class}, held to {self.cap} by ONEDNN_MAX_CPU_ISA" if self.cap else self.cpu_class


def openvino_isa(features=None, environ=None) -> OpenVinoIsa:
    """`features`: optpipe.hardware.cpu_features.detect()'s (injectable for tests); `environ`: os.environ."""
    features = features if features is not None else _detect()
    environ = os.environ if environ is None else environ
    cap = (environ.get("ONEDNN_MAX_CPU_ISA") or "").strip().upper() or None
    vnni = bool(getattr(features, "vnni", False) or getattr(features, "amx", False))
    avx512 = bool(getattr(features, "avx512", False))
    if cap is not None:
        vnni, avx512 = vnni and cap in VNNI_CAPS, avx512 and cap in AVX512_CAPS
    return OpenVinoIsa(cpu_class=str(getattr(features, "cpu_class", "unknown")), vnni=vnni, avx512=avx512, cap=cap)


def int8_skip_reason(isa: OpenVinoIsa) -> str | None:
    """The one line an int8 stage is skipped with on this CPU, or None where int8 can pay."""
    if isa.vnni or isa.avx512:
        return None
    return f"{SLOW_INT8} (this CPU: {isa.label}); the recipe's float candidates stand in (skip_slow_int8: false runs it)"


def _detect():
    """The CPU's features from optpipe.hardware.cpu_features (the `isa` work), or read from the
    CPU flags until that module is there: the same names, so this module does not change then."""
    try:
        from optpipe.hardware.cpu_features import detect  # type: ignore[import-not-found]
    except ImportError:
        return _flags_features()
    return detect()


@dataclass(frozen=True)
class _Features:
    vnni: bool
    amx: bool
    avx512: bool
    bf16: bool
    cpu_class: str


def _flags_features() -> _Features:
    flags: set[str] = set()
    try:
        line = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith(("flags", "Features"))), "")
        flags = set(line.split(":", 1)[1].split()) if ":" in line else set()
    except OSError:
        pass
    amx, avx512 = "amx_int8" in flags, "avx512f" in flags
    vnni = bool({"avx512_vnni", "avx_vnni"} & flags)
    if "asimd" in flags:
        name = "arm64"
    else:
        name = "amx" if amx else "avx512_vnni" if avx512 and vnni else "avx512" if avx512 else \
            "avx2_vnni" if vnni else "avx2" if "avx2" in flags else "sse"
    return _Features(vnni=vnni, amx=amx, avx512=avx512, bf16="avx512_bf16" in flags or "amx_bf16" in flags, cpu_class=name)
