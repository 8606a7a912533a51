"""The stages `optpipe init` writes for each kind of model (cnn, transformer, dense), in the order that
works, each with the comment the recipe carries; adjusted to what init read of the model."""
from __future__ import annotations

# Every kind's best CPU candidate on CPUs with VNNI/AMX (MiniLM 3.95x eager, ResNet-50 5.24x: docs/benchmarks.md);
# without VNNI it runs slower than OpenVINO FP32 and the stage is skipped, saying so: the FP32 IR beside it stands in.
OPENVINO_INT8 = ("ov-int8", "openvino", "simplify", {"precision": "int8"},
                 "OpenVINO IR, int8 by NNCF on the calibration set: the fastest CPU candidate where the CPU has VNNI "
                 "(skipped without: slower than FP32 there, docs/openvino.md)")
OPENVINO_FP32 = ("ov-fp32", "openvino", "simplify", {"precision": "fp32"},
                 "OpenVINO IR in FP32: lossless, and the OpenVINO candidate on CPUs without VNNI")
OPENVINO_BF16 = ("ov-bf16", "openvino", "simplify", {"precision": "bf16"},
                 "OpenVINO IR at the bf16 hint: lossless, 1.8-2.6x its FP32 with AVX-512 BF16 or AMX (skipped without them)")

STAGES = {
    "cnn": [
        ("export", "export", None, {}, "PyTorch -> ONNX (an .onnx source is imported as is)"),
        ("simplify", "simplify", "export", {}, "constant folding, dead code"),
        ("fp16", "fp16", "simplify", {}, "half precision, for GPUs"),
        ("int8", "int8", "simplify", {"mode": "static", "target": "ort-cpu"},
         "calibrated int8 on the calibration images; before fuse: FusedConv is not what ORT's quantizer quantizes"),
        ("fuse", "fuse", "simplify", {"transformer": "off"}, "Conv+BN+activation fusion for ONNX Runtime"),
        ("prune", "prune", "simplify", {"method": "structured", "amount": 0.25},
         "removes 25% of the channels, no fine-tuning: the report shows what it costs"),
        OPENVINO_INT8,
        OPENVINO_FP32,
        OPENVINO_BF16,
    ],
    "transformer": [
        ("export", "export", None, {}, "PyTorch -> ONNX (an .onnx source is imported as is)"),
        ("simplify", "simplify", "export", {}, "constant folding, dead code"),
        ("fuse", "fuse", "simplify", {}, "attention, layer norm and GELU fusion"),
        ("int8", "int8", "fuse", {"mode": "dynamic"}, "after fuse: dynamic int8 quantizes the fused attention's MatMuls"),
        ("fp16", "fp16", "fuse", {}, "half precision, for GPUs"),
        OPENVINO_INT8,
        OPENVINO_FP32,
        OPENVINO_BF16,
    ],
    "dense": [
        ("export", "export", None, {}, "PyTorch -> ONNX (an .onnx source is imported as is)"),
        ("simplify", "simplify", "export", {}, "constant folding, dead code"),
        ("fp16", "fp16", "simplify", {}, "half precision, for GPUs"),
        ("int8", "int8", "simplify", {"mode": "dynamic"}, "int8 weights, activations quantized at run time"),
        OPENVINO_INT8,
        OPENVINO_FP32,
        OPENVINO_BF16,
    ],
}


# The prune stage's kept channel counts are rounded up to the SIMD width (16 on AVX-512), so 25% of
# a convolution narrower than 4 x 16 channels rounds back to all of them, and the stage fails
# ("removes nothing"), as it did on a tiny CNN (16 channels). Narrow nets round to 4; under 16 channels none.
PRUNE_SIMD_WIDTH_MIN = 64
PRUNE_NARROW_MIN = 16


def stages_for(kind: str, conv_widths: list[int], left_out: tuple[str, ...] = ()) -> list[tuple]:
    """(name, pass, after, params, why) of each stage init writes for a model of this kind, but the passes `left_out`."""
    widest = max(conv_widths, default=None)
    stages = []
    for stage in STAGES[kind]:
        if stage[1] in left_out:
            continue
        if stage[1] == "prune" and widest is not None and widest < PRUNE_SIMD_WIDTH_MIN:
            if widest < PRUNE_NARROW_MIN:
                continue
            name, pass_name, after, params, why = stage
            stage = (name, pass_name, after, {**params, "round_to": 4},
                     f"{why}; kept counts rounded to 4: at the SIMD width its {widest}-channel convolutions would lose none")
        stages.append(stage)
    return stages


def passes_left_out(graph, inputs: list[dict]) -> tuple[tuple[str, ...], list[str]]:
    """The passes an ONNX file cannot take, and the recipe's note on each: int8 quantizes a float32 model (a float16 one
    failed in ORT's quantizer) and fp16 has nothing to do there; OpenVINO converts ONNX Runtime's own fused ops
    (com.microsoft: an Optimum -O2 or ORT-optimized file) wrongly or not at all (MiniLM's: cosine 0.69)."""
    left_out, notes = [], []
    if any(spec["dtype"] == "float16" for spec in inputs):
        left_out += ["int8", "fp16"]
        notes.append("no int8 or fp16 stage: the model computes in float16 already, and int8 quantizes a float32 model "
                     "(export it in float32 for them)")
    ort_ops = sorted({node.op_type for node in graph.node if node.domain == "com.microsoft"})
    if ort_ops:
        left_out.append("openvino")
        notes.append(f"no OpenVINO stage: the model holds ONNX Runtime's own ops ({', '.join(ort_ops[:4])}), which "
                     "OpenVINO converts wrongly or not at all; give the file from before ORT's optimizer for them")
    return tuple(left_out), notes


def stage_notes(kind: str, conv_widths: list[int]) -> list[str]:
    """What the recipe's header says about a stage left out."""
    widest = max(conv_widths, default=None)
    if kind == "cnn" and widest is not None and widest < PRUNE_NARROW_MIN:
        return [f"no prune stage: the widest convolution has {widest} channels, too few to remove 25% of"]
    return []
