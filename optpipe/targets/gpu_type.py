"""Whether a target that names a `gpu_type` was built on that GPU.

A TensorRT engine is specific to the GPU it was built on (it fails to load, or runs its tuned
kernels badly, on another), and any target's timings are the GPU's it ran on. With --executor ray
the `gpu:<type>` resource puts the task on a node that declares the type; built here (the local
executor, `optpipe export`) nothing does, so the local GPU is compared with the type and a
mismatch is said loudly: a warning line and the target's `gpu_check` in report.json and manifest.json.
"""
from __future__ import annotations

import re
from typing import Optional

from optpipe.core.runtime import cuda_device_names


def check_gpu_type(gpu_type: str, builds_engine: bool, names: Optional[list[str]] = None) -> dict:
    """{meant_for, built_on (this machine's GPU names, or `names`), matches, warning (None when it matches)}."""
    names = cuda_device_names() if names is None else names
    matches = any(gpu_type_matches(gpu_type, name) for name in names)
    warning = None
    if not matches:
        built_on = ", ".join(names) if names else "no GPU"
        why = ("a TensorRT engine runs only on the GPU type it was built for" if builds_engine
               else f"its figures are not the {gpu_type}'s")
        warning = (f"built on {built_on}, meant for {gpu_type}: {why}; build it on a {gpu_type} "
                   f"(--executor ray with a node declaring gpu:{gpu_type})")
    return {"meant_for": gpu_type, "built_on": names, "matches": matches, "warning": warning}


def gpu_type_matches(gpu_type: str, device_name: str) -> bool:
    """Does a driver's device name ("NVIDIA A100-SXM4-80GB") name this type ("a100-80gb")?

    Each part of the type (split at '-', '_', '.') must be one word of the name, or adjacent words
    run together ("rtx4090" in "NVIDIA GeForce RTX 4090"). A part must match whole words: "l4" is
    not "NVIDIA L40S".
    """
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    runs = {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
    parts = [p for p in re.split(r"[-_.]", gpu_type.lower()) if p]
    return bool(parts) and all(part in runs for part in parts)
