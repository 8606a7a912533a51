"""What a model computes, for `optpipe init`'s choice of stages: the share of its multiply-adds in
convolutions, and whether it multiplies activations by activations (attention).

Why by compute and not by class name: a SegFormer is a "transformer" by name but spends 42-62% of
its MACs in convolutions (measured: a tiny config and the default b0 at 512x512), and the recipe
that fits it is the CNN one (static int8 off `simplify`); a ConvNeXt is a CNN by name and does 93%
of its MACs in Linear layers, with no attention to fuse. torch's own FlopCounterMode counts a
PyTorch model's ops on the meta device (no weights allocated, no arithmetic done); an ONNX graph's
MACs come from the same counters as the int8 coverage (optpipe.graph.coverage).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optpipe.authoring.forward_inputs import meta_tensors, real_tensors
from optpipe.core.errors import ModelSourceError, first_line

# A net with at least this share of its MACs in convolutions gets the CNN recipe even beside
# attention (SegFormer 0.42-0.62; the vision transformers measured: ViT 0.007, Swin 0.003, a tiny CLIP 0.14).
CONV_SHARE_CNN = 0.3


@dataclass(frozen=True)
class ComputeMix:
    conv_share: float  # of all counted MACs
    attention_share: float  # activation x activation products (batched matmuls, attention cores)
    total: int
    # Attention layers by module (torch's flop counter has no formula for CPU SDPA kernels: a BERT
    # counts only its addmm, measured), so attention is seen even where its MACs are not.
    attention_layers: bool = False

    def kind(self) -> str:
        if self.total == 0:
            return "dense"
        attention = self.attention_share > 0 or self.attention_layers
        if self.conv_share >= CONV_SHARE_CNN or (self.conv_share > 0 and not attention):
            return "cnn"
        return "transformer" if attention else "dense"

    def describe(self) -> str:
        attention = (f"{self.attention_share:.0%} in attention" if self.attention_share or not self.attention_layers
                     else "attention layers (their MACs not counted)")
        return f"{self.conv_share:.0%} of its MACs in convolutions, {attention}"


def torch_mix(net, kwargs: dict, args: tuple = ()) -> ComputeMix | None:
    """The mix of one forward of `net` on `args`/`kwargs` (tensors, on the meta device or real); None
    when forward fails on them (the caller says so)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            net(*args, **kwargs)
    except Exception:  # a model that does not run on meta tensors, or on these inputs
        return None
    counts = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    total = sum(counts.values())
    conv = sum(n for op, n in counts.items() if "convolution" in op)
    attention = sum(n for op, n in counts.items() if "bmm" in op or "scaled_dot_product" in op or "baddbmm" in op)
    layers = any("Attention" in type(m).__name__ for m in net.modules())
    return ComputeMix(conv / total if total else 0.0, attention / total if total else 0.0, total, layers)


def onnx_mix(model, dims: dict[str, int]) -> ComputeMix:
    """The mix of an ONNX graph at `dims` (its symbolic dims' sizes)."""
    from optpipe.graph.coverage import ATTENTION_CORES, MAC_COUNTERS, node_macs
    from optpipe.graph.shapes import infer_shapes

    compute = [node for node in model.graph.node if node.op_type in MAC_COUNTERS or node.op_type in ATTENTION_CORES]
    types = infer_shapes(model, dims, known=lambda found: all(node_macs(n, found) is not None for n in compute))
    weights = {init.name for init in model.graph.initializer}
    conv = attention = total = 0
    for node in compute:
        for part, count in node_macs(node, types) or []:
            total += count
            if node.op_type in ("Conv", "ConvTranspose", "FusedConv"):
                conv += count
            elif part == "core" or (node.op_type == "MatMul" and not set(node.input[:2]) & weights):
                attention += count
    if total == 0:  # shapes unknown: fall back to what the graph has
        ops = {node.op_type for node in model.graph.node}
        return ComputeMix(1.0 if "Conv" in ops else 0.0, 1.0 if ops & {"Attention", "MultiHeadAttention", "Softmax"} else 0.0, 1)
    return ComputeMix(conv / total, attention / total, total)


def meta_model(folder: Path, task: str):
    """The folder's model class built from its config on the meta device (no weights read or
    allocated): its forward() says the inputs, one forward on meta tensors the compute."""
    import torch
    import transformers

    from optpipe.source.model_source import HF_AUTO_CLASSES

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            # float32 as the compile loads it (source/model_source.py): a config's bfloat16 would be built in bf16
            return getattr(transformers, HF_AUTO_CLASSES[task]).from_config(config, dtype=torch.float32).eval()
    except Exception as exc:  # an architecture transformers does not know, a config it cannot read
        raise ModelSourceError(f"init: cannot build the model of '{folder}' from its config.json as {task} "
                               f"({type(exc).__name__}: {first_line(exc)[:160]})") from None


# A model up to this many parameters is built for real (random weights, ~4 bytes each) when its
# forward() does not run on meta tensors (transformers' masks call .item()); a larger one is not.
REAL_BUILD_MAX_PARAMS = 300_000_000


def model_kind(net, inputs: list[dict], dims: dict, owner: str) -> tuple[str, list[str]]:
    """cnn | transformer | dense by what forward() computes (model_kind), with a note saying so."""
    mix = torch_mix(net, meta_tensors(inputs, dims)) if _on_meta(net) else None
    if mix is None and _on_meta(net):
        params = sum(p.numel() for p in net.parameters())
        if params > REAL_BUILD_MAX_PARAMS:
            kind = "transformer" if any(s["dtype"] == "int64" for s in inputs) else "cnn"
            return kind, [f"a {kind} recipe by its inputs: its compute was not measured ({params / 1e6:.0f}M parameters)"]
        import torch

        with torch.device("cpu"):
            net = type(net)(net.config).eval()  # random weights: only the op counts are read
    if mix is None:
        real = real_tensors(inputs, dims)
        mix = torch_mix(net, real)
        if mix is None:
            return _uncounted(net, real, (), inputs, f"{owner}.forward() does not run on the inputs inferred for it "
                                                    f"({', '.join(spec['name'] for spec in inputs)})")
    return mix.kind(), [f"a {mix.kind()} recipe: {mix.describe()}"]


def _uncounted(net, kwargs: dict, args: tuple, inputs: list[dict], refusal: str) -> tuple[str, list[str]]:
    """Where forward() failed under torch's FLOP counter: run it without. A model that runs so (a Mamba's reference
    scan met the counter's "Expected gradient function to be set", and init refused it) gets its kind by its inputs,
    said; one that fails anyway is refused with the reason it gave."""
    import torch

    try:
        with torch.no_grad():
            net(*args, **kwargs)
    except Exception as exc:
        raise ModelSourceError(f"init: {refusal}: {type(exc).__name__}: {first_line(exc)[:160]}; write `inputs` by "
                               "hand") from None
    kind = "transformer" if any(spec["dtype"].startswith("int") for spec in inputs) else "dense"
    return kind, [f"a {kind} recipe by its inputs: torch's FLOP counter does not run its forward(), so its compute "
                  "was not measured"]


def _on_meta(net) -> bool:
    """Any weight on the meta device: not only the first, which a legacy constructor may have put on the CPU
    (wav2vec2's `masked_spec_embed`, made by `torch.Tensor(...)`, which ignores the meta device)."""
    return any(p.is_meta for p in net.parameters())


def factory_kind(net, inputs: list[dict], dims: dict, owner: str) -> tuple[str, list[str]]:
    """A plain module's kind by its compute, its inputs given as the factory loader gives them (module_forms.input_binding:
    by name where they name forward()'s parameters and are not in its order, or are keyword-only)."""
    from optpipe.source.module_forms import input_binding, positional

    tensors = real_tensors(inputs, dims)
    by_name = input_binding(net, list(tensors), owner) is not positional
    kwargs, args = (tensors, ()) if by_name else ({}, tuple(tensors.values()))
    mix = torch_mix(net, kwargs, args)
    if mix is None:
        return _uncounted(net, kwargs, args, inputs, f"{owner}.forward() does not run on the inputs inferred for it")
    return mix.kind(), [f"a {mix.kind()} recipe: {mix.describe()}"]
