"""`optpipe init PATH`: a commented starting recipe from a model.

PATH is an ONNX file, a Hugging Face model folder (config.json) or a `module:factory` returning a
torch module. What the model tells is filled in (inputs, dtypes, dynamic dims, the head); what it
cannot tell (the data) is a marked placeholder. The stages are the standard DAG for the kind of
model, in the order that works: for a CNN int8 hangs off `simplify`, not off `fuse` (fused
Conv+activation is what the quantizer has to split again); for a transformer int8 follows `fuse`,
so dynamic int8 quantizes the fused attention's MatMuls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from optpipe.authoring.hf_tasks import HF_VERDICT_TASKS, architecture_task, task_keys, verdict_task
from optpipe.authoring.forward_inputs import (hf_inputs, input_entry, real_tensors, task_layout,
                                             unknown_required)
from optpipe.authoring.model_kind import factory_kind, meta_model, model_kind, onnx_mix
from optpipe.authoring.stage_sets import passes_left_out, stage_notes, stages_for
from optpipe.core.errors import ModelSourceError, first_line
from optpipe.safety.file_kinds import is_torchscript_archive, other_model_format
from optpipe.source.position_limit import onnx_position_limit
from optpipe.source.checkpoint_precision import as_float32, narrows, refuse_prequantized, stored_dtype
from optpipe.source.module_forms import (forward_parameters, input_binding, layer_kind, load_torchscript, refuse_unexportable,
                                         scripted_as_is)
from optpipe.source.model_source import TOKENIZER_FILES, hub_id_hint

FILL_IN = "FILL-IN"


@dataclass
class ModelFacts:
    """What `init` learned about a model."""

    name: str
    model: dict[str, Any]  # the recipe's `model` section
    inputs: list[dict[str, Any]]
    dims: dict[str, dict[str, int]]
    kind: str  # cnn | transformer | dense
    notes: list[str] = field(default_factory=list)
    task: Optional[str] = None  # evaluate.task.kind, where the model says what it is for
    conv_widths: list[int] = field(default_factory=list)  # output channels of each convolution
    left_out: tuple[str, ...] = ()  # passes this model cannot take (an ONNX file in float16, or with ORT-only ops)


def inspect_path(path: str, recipe_dir: Path) -> ModelFacts:
    """Facts about the model at `path` (a file, a folder or module:factory)."""
    local = Path(path)
    if local.suffix == ".onnx":
        if not local.is_file():
            raise ModelSourceError(f"init: '{path}' does not exist; give an .onnx file, a Hugging Face folder or module:factory")
        return _onnx_facts(local, recipe_dir)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelSourceError(f"init: folder '{path}' has no config.json; give a Hugging Face model folder")
        return _hf_facts(local, recipe_dir)
    if ":" in path and not local.exists():
        return _factory_facts(path, recipe_dir)
    if local.is_file() and is_torchscript_archive(local):
        net = load_torchscript(local, "init")
        return _module_facts(net, local.stem, {"torchscript": _relative(local.resolve(), recipe_dir)})
    other = other_model_format(local) if local.is_file() else None
    if other:
        raise ModelSourceError(f"init: '{path}' is {other}")
    hub = hub_id_hint(path) if not local.exists() else ""
    raise ModelSourceError(f"init: '{path}' is not an .onnx file, a Hugging Face folder or module:factory{hub}")


# --- ONNX ------------------------------------------------------------------------------------


def _onnx_facts(path: Path, recipe_dir: Path) -> ModelFacts:
    import onnx

    from optpipe.safety.onnx_guard import check_deterministic, check_tensor_outputs, load_graph

    graph = load_graph(path, "model.onnx")
    check_deterministic(graph, path.name, "init")  # compile would refuse it: no recipe written
    check_tensor_outputs(graph, path.name, "init")
    initializers = {t.name for t in graph.graph.initializer}
    vocab = _index_ranges(graph.graph)
    limit = onnx_position_limit(graph.graph)  # a position table bounds the token sequence
    positions = limit[1] if limit else None
    inputs, dims = [], {}
    for value in graph.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        shape = []
        for axis, dim in enumerate(tensor.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                shape.append(dim.dim_value)
                continue
            name = _dim_name(dim.dim_param, value.name, axis)
            dims.setdefault(name, _dim_range(name, axis, dtype, positions))
            shape.append(name)
        extra = {"range": [0, vocab[value.name]]} if value.name in vocab and dtype.startswith("int") else {}
        inputs.append(input_entry(value.name, dtype, shape, **extra))
    kind = onnx_mix(graph, {name: rng["opt"] for name, rng in dims.items()}).kind()
    outputs = [[d.dim_value if d.HasField("dim_value") else None for d in o.type.tensor_type.shape.dim] for o in graph.graph.output]
    widths = _onnx_conv_widths(graph.graph)
    model = {"onnx": _relative(path, recipe_dir)}
    if any((path.parent / name).is_file() for name in TOKENIZER_FILES):  # an Optimum export's folder: text data can be read
        model["tokenizer"] = {"hf": _relative(path.parent, recipe_dir)}
    left_out, notes = passes_left_out(graph.graph, inputs)
    return ModelFacts(path.stem, model, inputs, _rename_batch(inputs, dims), kind, notes,
                      task=_classifier_task(kind, outputs), conv_widths=widths, left_out=left_out)


def _onnx_conv_widths(graph) -> list[int]:
    """Output channels of each Conv whose weight is an initializer (its first dim)."""
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    return [shapes[node.input[1]][0] for node in graph.node
            if node.op_type == "Conv" and len(node.input) > 1 and shapes.get(node.input[1])]


def _torch_conv_widths(net) -> list[int]:
    import torch

    return [m.out_channels for m in net.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))]


def _index_ranges(graph) -> dict[str, int]:
    """Graph inputs that index a weight table (token ids into an embedding: a Gather of an
    initializer): the table's rows, the exclusive upper end of the ids' `range`. Without it the
    synthetic ids (0..100 by default) can run past a small vocabulary, which preflight refuses."""
    rows = {t.name: t.dims[0] for t in graph.initializer if t.dims}
    ranges: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in rows:
            ids = node.input[1]
            ranges[ids] = min(ranges.get(ids, rows[node.input[0]]), rows[node.input[0]])
    return ranges


def _dim_name(param: str, input_name: str, axis: int) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in param).strip("_")
    return cleaned or f"{input_name}_{axis}"


def _dim_range(name: str, axis: int, dtype: str, positions: int | None = None) -> dict[str, int]:
    if axis == 0:
        return {"min": 1, "opt": 1, "max": 16}
    if dtype.startswith("int"):  # a token sequence, within the model's position table where it has one
        longest = min(512, positions or 512)
        return {"min": 1, "opt": min(128, longest), "max": longest}
    return {"min": 32, "opt": 224, "max": 1024}


def _rename_batch(inputs: list[dict], dims: dict) -> dict:
    """The dim that leads every input is the batch: call it so."""
    firsts = {spec["shape"][0] for spec in inputs if spec["shape"]}
    if len(firsts) == 1 and isinstance(first := firsts.pop(), str) and first != "batch" and "batch" not in dims:
        dims["batch"] = dims.pop(first)
        for spec in inputs:
            spec["shape"] = ["batch" if d == first else d for d in spec["shape"]]
    return dims



# --- Hugging Face folder ---------------------------------------------------------------------

def _hf_facts(folder: Path, recipe_dir: Path) -> ModelFacts:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    refuse_prequantized(config, folder, "init")
    task = architecture_task(config)
    model: dict[str, Any] = {"hf": _relative(folder, recipe_dir), "task": task}
    if HF_VERDICT_TASKS.get(task) == "language-model":  # the logits alone (not the encoder's states or a past)
        model["outputs"] = ["logits"]
    try:
        net = meta_model(folder, task)
    except ModelSourceError:
        if "auto_map" not in config:
            raise
        # Its own modeling code, which transformers would import only with trust_remote_code: init runs none of it.
        raise ModelSourceError(
            f"init: '{folder}' is a model with its own code (config.json's auto_map), which init does not run; if you "
            "trust that code, write `model: {hf: FOLDER, trust_remote_code: true}` in a recipe yourself, or init a "
            "module:factory that builds the model") from None
    owner = type(net).__name__
    inputs, dims = hf_inputs(forward_parameters(net.forward), config, _tokenizer_inputs(folder), owner, net)
    task_layout(task, inputs, dims, config)
    kind, notes = model_kind(net, inputs, dims, owner)
    verdict, task_notes = verdict_task(task, config)
    notes += _widening_notes(stored_dtype(config)) + task_notes
    return ModelFacts(folder.name, model, inputs, dims, kind, notes, task=verdict, conv_widths=_torch_conv_widths(net))


def _classifier_task(kind: str, output_shapes: list[list]) -> Optional[str]:
    """A CNN with one [batch, classes] output (10 classes or more) is an image classifier: its verdict
    checks top-1 agreement. Other models' [batch, n] outputs may be regressions: no task guessed."""
    if kind != "cnn" or len(output_shapes) != 1:
        return None
    shape = output_shapes[0]
    return "classification" if len(shape) == 2 and isinstance(shape[1], int) and shape[1] >= 10 else None


def _tokenizer_inputs(folder: Path) -> list[str]:
    """The inputs the model's own tokenizer produces (token_type_ids only where it makes them)."""
    try:
        from transformers import AutoTokenizer

        names = list(AutoTokenizer.from_pretrained(str(folder), local_files_only=True).model_input_names)
    except Exception:  # no tokenizer in the folder: the usual pair
        names = ["input_ids", "attention_mask"]
    return [n for n in names if n in ("input_ids", "attention_mask", "token_type_ids")] or ["input_ids"]


def _widening_notes(stored: str | None) -> list[str]:
    how = "narrows them to float32 (rounded)" if stored and narrows(stored) else "widens them to float32 (exact)"
    return [f"its weights are {stored}: the compile {how}, and each stage takes its own precision from there"] if stored else []


# --- module:factory --------------------------------------------------------------------------


def _factory_facts(spec: str, recipe_dir: Path) -> ModelFacts:
    """A factory's module, called without arguments; its first weighted layer tells the input."""
    import importlib

    import torch

    import sys

    module_name, _, func_name = spec.partition(":")
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)  # a module beside the user, as `python -c` would find it
    try:
        module = importlib.import_module(module_name)
        net = getattr(module, func_name)()
    except Exception as exc:  # the user's code: report it as theirs
        raise ModelSourceError(f"init: cannot build '{spec}': {type(exc).__name__}: {first_line(exc)}; check the module and function names") from None
    net = net[0] if isinstance(net, tuple) else net
    refuse_unexportable(net, f"init: '{spec}'")
    if not isinstance(net, torch.nn.Module):
        raise ModelSourceError(f"init: '{spec}' returned {type(net).__name__}, not a torch.nn.Module")
    model: dict[str, Any] = {"factory": spec}
    origin = getattr(module, "__file__", None)
    if origin and Path(origin).resolve().is_relative_to(Path.cwd().resolve()):
        model["path"] = _relative(Path.cwd(), recipe_dir)  # compile finds the module from the recipe's folder
    return _module_facts(net, func_name, model)


def _module_facts(net, name: str, model: dict[str, Any]) -> ModelFacts:
    """A torch module's facts (a factory's, or a TorchScript archive's): its inputs, kind and outputs, probed."""
    converted = as_float32(net)  # measured in float32, as the compile loads it
    owner = type(net).__name__
    params = forward_parameters(net.forward)
    hf_config = getattr(net, "config", None)
    if hasattr(hf_config, "to_dict"):  # a transformers model: its config sizes every input
        inputs, dims = hf_inputs(params, hf_config.to_dict(), None, owner, net)
        notes = []
    else:
        inputs, dims, notes = _first_layer_input(net)
        notes += _sequence_first_notes(net)
        required = [name for name, needed in params if needed]
        # The first layer tells one input, no more; shown under forward()'s own name for it, which binds by name.
        unknown_required(params, set(required[:1]), owner, [{**inputs[0], "name": required[0]}] if required else inputs)
    notes += _widening_notes(converted)
    output_shapes = _probe(net, inputs, dims, owner)
    kind, kind_notes = (model_kind if hasattr(hf_config, "to_dict") else factory_kind)(net, inputs, dims, owner)
    notes += kind_notes
    return ModelFacts(name, model, inputs, dims, kind, notes, task=_classifier_task(kind, output_shapes),
                      conv_widths=_torch_conv_widths(net))


def _first_layer_input(net) -> tuple[list[dict], dict, list[str]]:
    """A plain module's one input, from its first weighted layer (the only thing that tells it). Read by class name and
    weight shape: a torch.jit.trace module's layers are TracedModules that keep only their `original_name`."""
    first = next((m for m in net.modules() if layer_kind(m) in FIRST_LAYERS and hasattr(m, "weight")), None)
    kind = layer_kind(first) if first is not None else None
    width = int(first.weight.shape[1] * getattr(first, "groups", 1)) if kind and kind.startswith("Conv") else None
    dims = {"batch": {"min": 1, "opt": 1, "max": 16}}
    if kind == "Conv2d":
        return [input_entry("images", "float32", ["batch", width, 224, 224])], dims, []
    if kind == "Conv3d":  # a video clip: 16 frames of 112 x 112, as R3D / X3D take them
        return [input_entry("video", "float32", ["batch", width, 16, 112, 112])], dims, []
    if kind in ("Embedding", "EmbeddingBag"):
        dims["sequence"] = {"min": 1, "opt": 128, "max": 512}
        return [input_entry("input_ids", "int64", ["batch", "sequence"], range=[0, int(first.weight.shape[0])])], dims, []
    if kind == "Conv1d":
        return [input_entry("signal", "float32", ["batch", width, 16000])], dims, []
    if kind == "Linear":
        return [input_entry("x", "float32", ["batch", int(first.weight.shape[1])])], dims, []
    return ([input_entry("x", "float32", ["batch", 3, 224, 224])], dims,
            ["no Conv/Linear/Embedding layer found: the input below is a guess, check it"])


#: torch.nn's sequence layers that take [sequence, batch, ...] unless built with batch_first=True
SEQUENCE_FIRST = ("LSTM", "GRU", "RNN", "MultiheadAttention", "Transformer", "TransformerEncoderLayer",
                  "TransformerDecoderLayer")


def _sequence_first_notes(net) -> list[str]:
    """A plain module whose recurrent or attention layer takes the sequence first: init's inputs lead with the batch,
    as optpipe feeds them, so the compile's samples check would warn; said here first, with the way out."""
    for name, module in net.named_modules():
        if layer_kind(module) in SEQUENCE_FIRST and getattr(module, "batch_first", True) is False:
            return [f"its {layer_kind(module)} '{name}' takes [sequence, batch, ...] (batch_first=False), while optpipe feeds "
                    "samples along every input's first dim: build it with batch_first=True (or transpose in forward()), "
                    "else the compile warns that the first dim is not a batch of independent samples"]
    return []


#: The layers whose weight tells a plain module's input, by class name.
FIRST_LAYERS = ("Conv1d", "Conv2d", "Conv3d", "Embedding", "EmbeddingBag", "Linear")


def _probe(net, inputs: list[dict], dims: dict, owner: str) -> list[list]:
    """Run forward once on the inferred inputs, bound as the factory loader binds them: the shapes
    of the tensors it returned, or a one-line refusal naming the inputs it did not take (a recipe
    with inputs the model refuses is not valid, whatever the schema says)."""
    import torch

    from optpipe.source.model_outputs import named_leaves

    try:
        tensors = real_tensors(inputs, dims)
        with torch.no_grad():
            out = input_binding(net, list(tensors), owner)(net.eval(), *tensors.values())
        leaves = named_leaves(out)
    except Exception as exc:  # a guessed shape the model does not take: the user writes `inputs`
        shown = ", ".join(f"{s['name']} {s['shape']}" for s in inputs)
        raise ModelSourceError(f"init: {owner}.forward() does not take the inferred input(s) {shown} "
                               f"({first_line(exc)[:120]}); write `inputs` by hand") from None
    scripted_as_is(net, out, list(range(len(leaves))))  # a TorchScript module the compile could not export: said now
    return [list(t.shape) for _, t in leaves]


# --- the recipe text -------------------------------------------------------------------------

TASK_WHY = {"classification": "the verdict also holds top-1 agreement (cosine alone lets classes flip)",
            "language-model": "the verdict also holds next-token agreement (cosine alone lets tokens flip)",
            "segmentation": "the verdict also holds per-pixel class agreement (cosine alone let 13% of a SegFormer's pixels flip)"}


def render_recipe(facts: ModelFacts, source: str) -> str:
    """The recipe as commented YAML."""
    flow = _flow
    lines = [f"# Recipe written by `optpipe init {source}`: a {facts.kind} model.",
             "# Filled in from the model: inputs, dtypes, dynamic dims, the stages. Check the dims' ranges,",
             f"# then replace every {FILL_IN} in `data` with your own samples and run `optpipe compile` on this file."]
    lines += [f"# NOTE: {note}" for note in facts.notes + stage_notes(facts.kind, facts.conv_widths)]
    lines += [f"name: {flow(facts.name)}", f"model: {flow(facts.model)}", "inputs:"]
    lines += [f"  - {flow(spec)}" for spec in facts.inputs]
    lines.append("dims:  # dynamic dims: the range the exported model accepts; `opt` is what latency is measured at")
    lines += [f"  {name}: {flow(rng)}" for name, rng in facts.dims.items()] or ["  {}"]
    lines += _data_section(facts)
    lines.append("stages:")
    for name, pass_name, after, params, why in stages_for(facts.kind, facts.conv_widths, facts.left_out):
        entry = {"pass": pass_name, **({"after": after} if after else {}), **({"params": params} if params else {})}
        lines.append(f"  {name}: {flow(entry)}  # {why}")
    lines += ["evaluate:",
              "  tolerance: {cosine_min: 0.99}  # per-output agreement with the export",
              *([f"  task: {{kind: {facts.task}{task_keys(facts.task, facts.model.get('task'), [i['name'] for i in facts.inputs])}}}  # {TASK_WHY[facts.task]}"] if facts.task else []),
              "  batch_sizes: [1]",
              "  threads: 2",
              f"output: runs/{facts.name}", ""]
    return "\n".join(lines)


def _flow(value: Any) -> str:
    """One value as inline YAML (quoted where YAML needs it)."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1000).strip().removesuffix("...").strip()


def _data_section(facts: ModelFacts) -> list[str]:
    image = next((s for s in facts.inputs if len(s["shape"]) == 4 and s["dtype"].startswith("float")), None)
    text = all(s["dtype"] == "int64" for s in facts.inputs) and ("hf" in facts.model or "tokenizer" in facts.model)
    lines = ["data:  # `source: synthetic` (no path) runs at once, but its accuracy figures mean little"]
    if image is not None:
        fixed = all(isinstance(d, int) for d in image["shape"][2:])
        crop = "" if fixed else ", crop: 224"
        for which, samples in (("eval", 16), ("calibration", 32)):
            lines.append(f"  {which}: {{source: images, path: {FILL_IN}/a-folder-of-images, samples: {samples}, "
                         f"preprocess: {{resize: 256{crop}}}}}  # {FILL_IN}: your images (mean/std default to ImageNet's)")
    elif text:
        for which, samples in (("eval", 32), ("calibration", 64)):
            lines.append(f"  {which}: {{source: text, path: {FILL_IN}/sentences.txt, samples: {samples}}}  # {FILL_IN}: one text per line")
    else:
        for which, samples in (("eval", 32), ("calibration", 64)):
            lines.append(f"  {which}: {{source: npz, path: {FILL_IN}/samples.npz, samples: {samples}}}  "
                         f"# {FILL_IN}: arrays named after the inputs, samples along axis 0")
    return lines


def _relative(path: Path, base: Path) -> str:
    """`path` relative to the recipe's folder where it can be (recipes resolve paths from there)."""
    import os

    return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
