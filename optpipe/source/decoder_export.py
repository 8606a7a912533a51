"""Export a Hugging Face causal LM as a decoder with its KV cache: one ONNX graph for prefill and decode.

Inputs: `input_ids [batch, sequence]`, `attention_mask [batch, total_sequence]` and, per layer,
`past_key_values.<i>.key / .value [batch, kv_heads, past_sequence, head_dim]`; outputs `logits
[batch, sequence, vocab]` and `present.<i>.key / .value [batch, kv_heads, total_sequence, head_dim]`.
Prefill feeds a past of length 0 (ONNX Runtime and OpenVINO both take empty tensors), decode feeds
the previous step's presents: the input-name layout ONNX Runtime GenAI and Optimum use.

Exporter: `torch.onnx.export(dynamo=True)` over a wrapper that rebuilds transformers' DynamicCache
from flat tensors (torch.export cannot take a Cache object as an input). Chosen because it is the
maintained path in torch 2.9+ and it exported Llama- and GPT-2-style models of transformers 5
here. Not tried: optimum's ONNX export and ONNX Runtime GenAI's model builder (neither is installed
in this environment). OpenVINO reads the ONNX this writes directly (passes/openvino_weights.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from optpipe.core.errors import ModelSourceError, root_first_line

INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"
BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past_sequence", "total_sequence"


@dataclass(frozen=True)
class DecoderLayout:
    """What a generation loop needs to drive the exported graph (written beside it as decoder.json)."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_batch: int
    max_sequence: int
    max_past: int
    exporter: str = "torch.onnx dynamo (DynamicCache from flat tensors)"

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DecoderLayout":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def hf_causal_lm(torch_model):
    """The transformers model inside optpipe's TorchModel wrapper (source/model_outputs.flat_module)."""
    model = getattr(torch_model.module, "model", None)
    if model is None or not hasattr(model, "config") or not hasattr(model, "generate"):
        raise ModelSourceError("evaluate.generation: the model is not a transformers causal LM (no generate()); "
                               "use `model: {hf: FOLDER, task: causal-lm}`, or remove evaluate.generation")
    return model


def cache_keyword(model) -> str:
    """The keyword a causal LM takes its KV cache by: `cache` from the transformers releases that renamed it (5.x;
    5.25 warns that `past_key_values` goes in 5.40), `past_key_values` before them. Asked once per model, not per
    step: eager's timed decode steps must not pay for the signature's inspection."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output):
    """The forward's updated cache, under either name (`cache` from transformers 5.x, `past_key_values` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def layout_of(model, max_batch: int, max_sequence: int, max_past: int) -> DecoderLayout:
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return DecoderLayout(layers=config.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, vocab=config.vocab_size,
                         max_batch=max_batch, max_sequence=max_sequence, max_past=max_past)


def export_decoder(model, folder: Path, max_batch: int = 8, max_sequence: int = 256, max_past: int = 512,
                   opset: int = 20) -> DecoderLayout:
    """Write `folder/model.onnx` (+ model.onnx.data) and return its layout. `model`: an HF causal LM in eval mode."""
    import torch

    layout = layout_of(model, max_batch, max_sequence, max_past)
    wrapper = _FlatCache(model, layout.layers).eval()
    example_ids = torch.zeros((2, 3), dtype=torch.int64)
    example_mask = torch.ones((2, 5), dtype=torch.int64)
    example_past = [torch.zeros((2, layout.kv_heads, 2, layout.head_dim)) for _ in layout.past_names]
    # torch.export refuses a Dim whose max equals its min ("inconsistent min=1, max=1"): a recipe whose batch
    # (or sequence) max is 1 still gets a dynamic dim; the layout keeps the recipe's maxima for the checks.
    batch = torch.export.Dim(BATCH, min=1, max=max(max_batch, 2))
    sequence = torch.export.Dim(SEQUENCE, min=1, max=max(max_sequence, 2))
    past = torch.export.Dim(PAST, min=1, max=max(max_past, 2))
    shapes = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: torch.export.Dim.AUTO},
              "past": [{0: batch, 2: past} for _ in layout.past_names]}
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                wrapper, (example_ids, example_mask, example_past), dynamo=True, dynamic_shapes=shapes, opset_version=opset,
                input_names=[INPUT_IDS, ATTENTION_MASK, *layout.past_names], output_names=[LOGITS, *layout.present_names],
                verbose=False,
            )
        program.save(str(folder / "model.onnx"), external_data=True)
        del program
    except Exception as exc:  # torch.export / the ONNX translation raise many kinds on unsupported models
        raise ModelSourceError(f"torch.onnx could not export this causal LM with its KV cache: {root_first_line(exc)}; "
                               "check that the model is a transformers causal LM that takes `past_key_values`") from None
    _name_dims(folder / "model.onnx")
    return layout


class _FlatCache:
    """forward(input_ids, attention_mask, past) with past a flat list [k0, v0, k1, v1, ...]; built lazily
    as a torch.nn.Module so that importing this file does not import torch."""

    def __new__(cls, model, layers: int):
        import torch
        from transformers import DynamicCache

        keyword = cache_keyword(model)

        class FlatCache(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, past):
                # Every layer a full one, sliding-window layers too: the graph has one past dim for all layers, and
                # the model's sliding mask still limits those layers to their window (eager, whose cache keeps only
                # the window, gives the same tokens: the generation check). A cache built from the config caps a
                # sliding layer's past at its window - 1, which torch.export refused for any longer past.
                cache = DynamicCache()
                for i in range(layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{keyword: cache})
                presents = []
                for layer in cache_of(out).layers[:layers]:
                    presents += [layer.keys, layer.values]
                return (out.logits, *presents)

        return FlatCache()


def _name_dims(path: Path) -> None:
    """torch.export names the mask's and the presents' length after its symbols ('s53', 'past + sequence'):
    give them one name, total_sequence, so shapes read as the layout says. Only the graph is rewritten."""
    model = onnx.load(str(path), load_external_data=False)
    for value in [*model.graph.input, *model.graph.output]:
        if value.name == ATTENTION_MASK or value.name.startswith("present."):
            axis = 1 if value.name == ATTENTION_MASK else 2
            value.type.tensor_type.shape.dim[axis].dim_param = TOTAL
    onnx.save_model(model, str(path))  # the tensors keep pointing at the external data file written beside it
