"""The CPU features that change kernels and numerics, and the CPU class they make.

Why it matters (issue 17): ORT's int8 GEMMs multiply u8 x s8 into saturating 16-bit sums on x86
without VNNI (VPMADDUBSW), so the same quantized model scores differently on an AVX2 and on a
VNNI machine; OpenVINO's INT8 was slower than its FP32 without VNNI. A result decided on one
class (a guard's exclusions, an accuracy figure, a latency) must not be reused on another: the
class joins the cache keys of such results and is recorded beside every figure.

Source of the features, and why not a library: on Linux, the kernel's /proc/cpuinfo flags. They
are what the OS has enabled (an AVX-512 or AMX unit whose register state the kernel does not
save is not listed), which raw CPUID readers (py-cpuinfo) do not check; archspec (Spack) reads
the same flags but reports the *closest known microarchitecture's* features (this Sapphire Rapids
VM came back as `icelake`, without AMX); OpenVINO's OPTIMIZATION_CAPABILITIES names precisions
(FP32, BF16, INT8), not ISAs, and does not change under ONEDNN_MAX_CPU_ISA. macOS answers
`sysctl hw.optional`; elsewhere the features are unknown and every choice takes its safe branch.

Injectable: OPTPIPE_CPU_FEATURES="avx2,fma" (or "arm64:asimd,asimddp") replaces detection, so
the per-ISA choices are testable on any machine. ONEDNN_MAX_CPU_ISA holds oneDNN (OpenVINO's CPU
plugin) below the machine's ISA: `engine_target("openvino")` is the restricted view.
"""
from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Mapping

FEATURES_ENV = "OPTPIPE_CPU_FEATURES"
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
Engine = Literal["onnxruntime", "openvino", "torch"]

#: x86 flags (as Linux names them) that change which int8/bf16/fp16 kernels run.
X86_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_int8", "amx_bf16", "amx_fp16")
#: Arm flags (Linux names): NEON, its dot product (SDOT/UDOT), int8 matrix multiply, SVE, BF16.
ARM_FEATURES = ("asimd", "asimddp", "i8mm", "sve", "sve2", "bf16")
ARM_ARCHES = ("arm64", "aarch64")

# What oneDNN may use at each ONEDNN_MAX_CPU_ISA value (its documented names): the machine's
# features outside the set are invisible to it. AVX2 machines see no difference at AVX2 and above.
_AVX2 = {"avx2", "fma"}
_AVX512 = _AVX2 | {"avx512f", "avx512bw"}
_ONEDNN_ALLOWS: dict[str, set[str]] = {
    "SSE41": set(),
    "AVX": set(),
    "AVX2": _AVX2,
    "AVX2_VNNI": _AVX2 | {"avx_vnni"},
    "AVX2_VNNI_2": _AVX2 | {"avx_vnni"},
    "AVX512_CORE": _AVX512,
    "AVX512_CORE_VNNI": _AVX512 | {"avx512_vnni"},
    "AVX512_CORE_BF16": _AVX512 | {"avx512_vnni", "avx512_bf16"},
    "AVX512_CORE_FP16": _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni"},
    "AVX512_CORE_AMX": _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"},
}


@dataclass(frozen=True)
class CpuTarget:
    """A CPU as the kernels see it: its architecture and the features among X86_/ARM_FEATURES."""

    arch: str  # "x86_64", "arm64", or platform.machine() of anything else
    features: frozenset[str]
    source: str  # where the features came from: /proc/cpuinfo, sysctl, OPTPIPE_CPU_FEATURES, unknown
    restricted_by: str | None = None  # "ONEDNN_MAX_CPU_ISA=AVX2" when this is oneDNN's restricted view

    @property
    def cpu_class(self) -> str:
        return cpu_class(self.arch, self.features, known=self.source != "unknown")

    def has(self, *names: str) -> bool:
        return all(name in self.features for name in names)

    def key(self) -> dict:
        """What a cache key holds: results decided on one class are not reused on another."""
        return {"class": self.cpu_class, "features": sorted(self.features)}

    def record(self) -> dict:
        """What report.json, the manifest and the stage info say about the CPU."""
        return {"class": self.cpu_class, "arch": self.arch, "features": sorted(self.features), "source": self.source,
                "restricted_by": self.restricted_by}


def cpu_class(arch: str, features: frozenset[str] | set[str], known: bool = True) -> str:
    """x86-amx, x86-avx512-vnni, x86-avx512, x86-avx2-vnni, x86-avx2, x86-sse; arm64-i8mm,
    arm64-dotprod, arm64-neon; `<arch>-unknown` where nothing could be read."""
    if not known:
        return f"{'arm64' if arch in ARM_ARCHES else arch}-unknown"
    if arch == "x86_64":
        if {"amx_tile", "amx_int8"} <= features:
            return "x86-amx"
        if "avx512f" in features:
            return "x86-avx512-vnni" if "avx512_vnni" in features else "x86-avx512"
        if "avx2" in features:
            return "x86-avx2-vnni" if "avx_vnni" in features else "x86-avx2"
        return "x86-sse"
    if arch in ARM_ARCHES:
        if "i8mm" in features:
            return "arm64-i8mm"
        return "arm64-dotprod" if "asimddp" in features else "arm64-neon"
    return arch


#: The x86 classes whose int8 dot products accumulate into int32 (VNNI in some form).
INT32_ACCUMULATING = ("x86-avx512-vnni", "x86-amx", "x86-avx2-vnni")


def int8_sums_saturate(target: CpuTarget) -> bool:
    """True where u8 x s8 int8 products are summed in pairs into a saturating int16 (VPMADDUBSW: x86
    without VNNI, unknown x86 included): ORT's MLAS and oneDNN both then need 7-bit weights
    (ORT reduce_range; NNCF OverflowFix.ENABLE) or another kernel. Measured on the attention graph of
    tests/test_openvino.py under ONEDNN_MAX_CPU_ISA=AVX2: NNCF's default overflow fix (first layer
    only) gave cosine 0.967 (worst row 0.40) against OpenVINO FP32, OverflowFix.ENABLE 0.998 (0.90),
    the same as unrestricted on AMX."""
    return target.arch == "x86_64" and target.cpu_class not in INT32_ACCUMULATING


def native_bf16(target: CpuTarget) -> bool:
    """bf16 arithmetic in hardware: AVX-512 BF16 or AMX on x86, the BF16 extension on Arm."""
    return bool(target.features & {"avx512_bf16", "amx_bf16", "bf16"})


def machine_target() -> CpuTarget:
    """The CPU this process runs on (or the injected OPTPIPE_CPU_FEATURES)."""
    return _detect(os.environ.get(FEATURES_ENV, ""))


def hardware_target() -> CpuTarget:
    """The CPU's own features, whatever OPTPIPE_CPU_FEATURES says: what ORT's MLAS and PyTorch
    dispatch their kernels on when optpipe's choices are made for an injected class (benchmarks say both)."""
    return _detect("")


def engine_target(engine: Engine = "onnxruntime") -> CpuTarget:
    """The CPU as `engine` uses it: OpenVINO (oneDNN) under ONEDNN_MAX_CPU_ISA sees only part of it.
    ORT's MLAS and PyTorch dispatch on the machine's own features."""
    target = machine_target()
    if engine != "openvino":
        return target
    return restrict(target, os.environ.get(ONEDNN_ENV, ""))


def restrict(target: CpuTarget, max_isa: str) -> CpuTarget:
    """`target` as oneDNN sees it at ONEDNN_MAX_CPU_ISA=`max_isa` (an unknown value restricts nothing,
    as oneDNN ignores it)."""
    allowed = _ONEDNN_ALLOWS.get(max_isa.strip().upper())
    if allowed is None or target.arch != "x86_64":
        return target
    kept = frozenset(f for f in target.features if f in allowed)
    return CpuTarget(target.arch, kept, target.source, f"{ONEDNN_ENV}={max_isa.strip().upper()}")


def cpu_record() -> dict:
    """The machine's CPU and, where ONEDNN_MAX_CPU_ISA holds OpenVINO lower, OpenVINO's view: for reports."""
    machine, openvino = machine_target(), engine_target("openvino")
    record = machine.record()
    record["openvino_class"] = openvino.cpu_class
    if openvino.restricted_by:
        record["openvino_restricted_by"] = openvino.restricted_by
    return record


def machine_id() -> dict:
    """Latency and int8 numerics belong to a machine and its CPU class: the key of a measurement holds
    both, and OpenVINO's view of the CPU (ONEDNN_MAX_CPU_ISA restricts it without changing the machine);
    and a container's CPU quota where one is set (its throttling changes every latency on the same machine)."""
    from optpipe.hardware.container_limits import read_limits

    quota = read_limits().cpu_quota
    return {"node": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "cpu_class": engine_target("onnxruntime").key(), "openvino_cpu_class": engine_target("openvino").key(),
            **({"cpu_quota": round(quota, 2)} if quota is not None else {})}


def parse_features(text: str) -> CpuTarget:
    """OPTPIPE_CPU_FEATURES's value: comma/space separated Linux flag names, optionally after
    `x86_64:` or `arm64:`; without one, Arm flag names make it arm64, anything else x86_64."""
    arch, _, names = text.rpartition(":")
    flags = {name.strip().lower() for name in names.replace(",", " ").split() if name.strip()}
    arch = arch.strip().lower()
    if not arch:
        arch = "arm64" if flags & (set(ARM_FEATURES) - {"bf16"}) else "x86_64"
    arch = "arm64" if arch in ARM_ARCHES else arch
    return CpuTarget(arch, _relevant(arch, flags), FEATURES_ENV)


@lru_cache(maxsize=8)
def _detect(injected: str) -> CpuTarget:
    if injected.strip():
        return parse_features(injected)
    arch = _arch()
    flags, source = _linux_flags()
    if flags is None and platform.system() == "Darwin":
        flags, source = _darwin_flags(arch), "sysctl"
    if flags is None:
        return CpuTarget(arch, frozenset(), "unknown")
    return CpuTarget(arch, _relevant(arch, flags), source)


def _arch() -> str:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64"
    return "arm64" if machine in ARM_ARCHES else machine


def _relevant(arch: str, flags: set[str]) -> frozenset[str]:
    known = ARM_FEATURES if arch == "arm64" else X86_FEATURES
    return frozenset(flag for flag in flags if flag in known)


def _linux_flags() -> tuple[set[str] | None, str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86 writes "flags", arm64 "Features"
                return set(line.split(":", 1)[1].split()), "/proc/cpuinfo"
    except OSError:
        pass
    return None, "unknown"


# macOS's sysctl names for the features above (Apple silicon: hw.optional.arm.FEAT_*).
_DARWIN_NAMES = {"hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.arm.FEAT_I8MM": "i8mm",
                 "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.neon": "asimd", "hw.optional.avx2_0": "avx2",
                 "hw.optional.fma": "fma", "hw.optional.avx512f": "avx512f", "hw.optional.avx512bw": "avx512bw",
                 "hw.optional.avx512vnni": "avx512_vnni"}


def _darwin_flags(arch: str) -> set[str] | None:
    try:
        out = subprocess.run(["sysctl", *_DARWIN_NAMES], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    flags = set()
    for line in out.splitlines():
        name, _, value = line.partition(":")
        if value.strip() == "1" and name.strip() in _DARWIN_NAMES:
            flags.add(_DARWIN_NAMES[name.strip()])
    return flags
