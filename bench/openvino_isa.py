"""OpenVINO INT8 vs FP32 on MiniLM per CPU class, on one machine: oneDNN held to each ISA in turn.

    python bench/openvino_isa.py [--isa native,AVX512_CORE_VNNI,AVX512_CORE,AVX2_VNNI,AVX2] [--rounds 6]

Each ISA runs bench/openvino_minilm.py (eager, ORT FP32, OpenVINO FP32, OpenVINO INT8, interleaved
in one process) in its own process with ONEDNN_MAX_CPU_ISA set, which caps the kernels OpenVINO's
CPU plugin (oneDNN and its own JIT kernels) picks: AVX2 gives an AVX2-only CPU's int8 path (no VNNI)
and its numerics on a VNNI machine. ONNX Runtime and PyTorch keep the machine's own ISA (MLAS has
no such switch): their rows are this CPU's, not the capped one's. The IRs are built once (cached
stages) and are the same bytes under every ISA. This is the measurement the openvino pass's CPU
rule (passes/_openvino_isa.py) rests on; the tables go to docs/openvino.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="native,AVX512_CORE_VNNI,AVX512_CORE,AVX2_VNNI,AVX2")
    parser.add_argument("--rounds", default="6")
    parser.add_argument("--iterations", default="10")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--variants", default="ov-fp32,ov-int8")
    args = parser.parse_args()
    code = 0
    for isa in args.isa.split(","):
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa != "native":
            env["ONEDNN_MAX_CPU_ISA"] = isa
        print(f"\n## OpenVINO held to {isa}" if isa != "native" else "\n## native ISA", flush=True)
        done = subprocess.run([sys.executable, str(REPO / "bench" / "openvino_minilm.py"), "--variants", args.variants,
                               "--batch", args.batch, "--rounds", args.rounds, "--iterations", args.iterations], env=env)
        code = code or done.returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
