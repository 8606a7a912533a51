"""The precision a checkpoint comes in: half precision widened to float32 (exactly), float64 narrowed, quantized
already refused.

Every pass and the eager reference start from float32 weights. Hub checkpoints mostly ship in bfloat16, which
transformers 5 loads as stored: export and eager failed on it ("unsupported ScalarType BFloat16"). A checkpoint
quantized already (GPTQ, AWQ, torch.ao) has no float weights to start from at all.
"""
from __future__ import annotations

import json
from pathlib import Path

from optpipe.core.errors import ModelSourceError


#: Half-precision weights as checkpoints ship them (most hub decoders: bfloat16), by their names in configs and torch.
HALF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def as_float32(net) -> str | None:
    """A module whose weights are not float32 converted to float32 in place; their dtype(s) before, or None.

    Half precision (bfloat16, float16: most hub checkpoints) is widened. Every pass and the eager reference start from
    float32: numpy (the evaluation, the checks) has no bfloat16, ONNX Runtime's CPU kernels run few bfloat16 ops, and
    the precision a stage asks for (fp16, bf16, int8) is the pass's to take, from the exact values. Widening is exact
    (Optimum's export loads in float32 the same way). Float64 parameters (a scientific model, a module `.double()`d)
    are narrowed: the recipe's inputs are float32 at most, so init could infer no input and the compile could not
    feed the model at all; no CPU engine runs float64 fast. That rounds the weights (said in the model's description).
    A float64 buffer beside float32 weights (a step counter) is left alone."""
    floats = [t for t in [*net.parameters(), *net.buffers()] if t.is_floating_point()]
    kinds = {str(t.dtype).removeprefix("torch.") for t in floats}
    changed = kinds & set(HALF_DTYPES.values())
    if any(p.dtype.is_floating_point and p.dtype.itemsize == 8 for p in net.parameters()):
        changed |= kinds & {"float64"}
    if not changed:
        return None
    net.float()
    return "/".join(sorted(changed))


def folder_config(folder: Path) -> dict:
    """A Hugging Face folder's config.json as a mapping; {} where it cannot be read (transformers then says why)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def refuse_prequantized(config: dict, folder: Path, owner: str) -> None:
    """A checkpoint quantized already (config.json's quantization_config: GPTQ, AWQ, bitsandbytes, FP8...) has no float
    weights to start from: transformers would ask for that method's own kernels package, and an export of them would
    not be the float model every stage is measured against. Refused, naming the method."""
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict):
        method = quantization.get("quant_method", "unnamed")
        bits = f", {quantization['bits']} bits" if "bits" in quantization else ""
        raise ModelSourceError(
            f"{owner}: '{folder}' is a checkpoint quantized already ({method}{bits}: config.json's "
            "quantization_config); optpipe compiles from float weights: give the float checkpoint it was made from "
            "(the weight_only and openvino_weights passes quantize it, measured against the float model)")


def refuse_quantized_modules(net, owner: str = "model") -> None:
    """A module quantized in PyTorch already (torch.ao's quantized Linear, Conv...: packed int8 weights) neither exports
    to ONNX ('quantized::linear_dynamic is not supported') nor has float weights for the stages to start from."""
    quantized = sorted({type(m).__module__ + "." + type(m).__name__ for m in net.modules()
                        if ".quantized" in type(m).__module__ and type(m).__module__.startswith("torch.")})
    if quantized:
        raise ModelSourceError(f"{owner}: the module is quantized in PyTorch already ({', '.join(quantized[:3])}); give it "
                               "before torch.ao's quantization: the int8 and openvino passes quantize it, measured against "
                               "the float model")


def stored_dtype(config: dict) -> str | None:
    """The half-precision dtype a Hugging Face config says its weights are stored in, else None."""
    return HALF_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))


def narrows(stored: str) -> bool:
    """Whether as_float32 rounded these dtypes (float64), rather than widening them exactly (half precision)."""
    return "float64" in stored


def widening_note(stored: str | None) -> str:
    if not stored:
        return ""
    if narrows(stored):
        return f" (weights in {stored}, narrowed to float32: rounded; every stage is measured against the float32 model)"
    return f" (weights stored in {stored}, widened to float32: exact)"
