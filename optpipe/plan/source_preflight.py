"""Preflight checks that read the model source itself, after safety/preflight.py's (called beside it by
the compile and the search; here, not in safety/, because they read optpipe/source/):

- memory: the estimated peak per stage, before anything loads, from a PyTorch / Hugging Face source's FP32
  weight bytes (source/torch_weights.py: safetensors headers or the config) or an ONNX source's files; a
  pass's peak may depend on how it runs on weights that large (its worker), which only this layer sees. A stage
  that will not fit fails before it runs, with its line, and the other branches run;
- a decoder measured by generation (evaluate.generation): the prompts fit the export's sequence dim
  (tokenized as the evaluation will), and an ONNX source has the past_key_values inputs of a
  KV-cache export.
Each ends in one line naming what to change (exit 2)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Union

from optpipe.core.errors import RecipeError
from optpipe.core.results import EAGER
from optpipe.recipe.generation_spec import decoder_dims
from optpipe.recipe.schema import HFConfigModel, HFModel, Recipe

if TYPE_CHECKING:
    from optpipe.plan.compile_plan import CompilePlan

#: What the memory estimate reads: a recipe (the driver, before the run) or the compile plan a task got (a stage about
#: to run on a node of a fan-out: a search trial's own params). Both have the stages' passes and params, the evaluate
#: section and the model source.
Sizable = Union[Recipe, "CompilePlan"]

PAST_PREFIX = "past_key_values."


def source_preflight(recipe: Recipe, onnx_path: Path | None) -> dict[str, str]:
    """The stages that will not fit this machine's memory (or its container's), each with its line: they fail before
    they run, and the other branches run. Where nothing could run, the run is refused here."""
    refused = memory_refusals(recipe, onnx_path)
    check_generation(recipe, onnx_path)
    return refused


def memory_refusals(recipe: Recipe, onnx_path: Path | None) -> dict[str, str]:
    """Each stage's estimated peak against the memory available (safety/memory_estimate.py): stage -> why it will
    not fit. Where nothing could run (no first stage fits, or the eager baseline every figure is measured against
    does not), the run is refused at once, naming the stage. No estimate for sources that must run to know their size."""
    from optpipe.safety.memory_estimate import refusal

    refused = _over_budget(recipe, onnx_path)
    roots = [name for name, stage in recipe.stages.items() if stage.after is None]
    blocking = [roots[0]] if roots and all(name in refused for name in roots) else []
    blocking += [name for name in refused if name not in recipe.stages]  # the eager baseline
    if blocking:
        raise refusal(refused, blocking[0])
    return refused


def node_refusals(plan: CompilePlan) -> dict[str, str]:
    """memory_refusals' lines for the stages of a plan (and its eager baseline's evaluation, "pytorch-eager"), against
    the memory of the machine this runs on, refusing nothing at once: a fan-out's task checks its stage where it runs
    (a Ray node has its own memory; a search trial its own params), and the stage fails before it runs where it will
    not fit, while the other stages go on."""
    from optpipe.source.model_source import onnx_path

    return _over_budget(plan, onnx_path(plan.model_source()))


def _over_budget(recipe: Sizable, onnx_path: Path | None) -> dict[str, str]:
    """stage (and the eager baseline) -> why it will not fit this machine's memory; {} for a source of unknown size."""
    from optpipe.safety.memory_estimate import over_budget

    sized = _sizing(recipe, onnx_path)
    if sized is None:
        return {}
    weights, steps, held, tied = sized
    return over_budget(weights, steps, held=held, tied_table=tied)


def memory_estimates(recipe: Recipe, onnx_path: Path | None) -> dict[str, int]:
    """stage (and the eager baseline's evaluation) -> estimated peak bytes, as memory_refusals compares them; {} where
    the source cannot tell its size before it runs (bench/memory.py prints them beside the measured peaks)."""
    from optpipe.safety.memory_estimate import stage_estimates

    sized = _sizing(recipe, onnx_path)
    return {} if sized is None else stage_estimates(*sized)


def _sizing(recipe: Sizable, onnx_path: Path | None) -> tuple[int, dict[str, str], int, int] | None:
    return _onnx_sizing(recipe, onnx_path) if onnx_path is not None else _torch_sizing(recipe)


def _onnx_sizing(recipe: Sizable, path: Path) -> tuple[int, dict[str, str], int, int]:
    """(weight bytes, stage -> kind of step, bytes held beside the passes, a tied head's table bytes) of an ONNX
    source: its weight bytes are the model file and its external data."""
    import onnx

    from optpipe.graph.matmul_weights import tied_heads
    from optpipe.safety.memory_estimate import WEIGHT_ONLY_COPY
    from optpipe.safety.onnx_guard import external_files

    model = onnx.load(str(path), load_external_data=False)
    data = external_files(model, path.parent).values()
    weights = path.stat().st_size + sum(file.stat().st_size for file in data if file.is_file())
    steps = stage_steps(recipe, weights)
    tied = 0
    if WEIGHT_ONLY_COPY in steps.values():  # HQQ writes a tied head's table transposed: its dims say its size
        tied = max((4 * math.prod(table.dims) for _, _, table in tied_heads(model)), default=0)
    return weights, steps, 0, tied


def _torch_sizing(recipe: Sizable) -> tuple[int, dict[str, str], int, int] | None:
    """The same for a PyTorch / Hugging Face source: its FP32 weight bytes from the safetensors headers or the
    config (source/torch_weights.py), before anything loads; the eager baseline holds the model as the export does."""
    from optpipe.safety.memory_estimate import WEIGHT_ONLY_COPY
    from optpipe.source.torch_weights import fp32_weight_bytes, held_beside_passes, tied_table_bytes

    source = recipe.model_source()
    weights = fp32_weight_bytes(source)
    if weights is None:
        return None
    steps = estimated_steps(recipe, weights)
    tied = tied_table_bytes(source) if WEIGHT_ONLY_COPY in steps.values() else 0
    return weights, steps, held_beside_passes(weights), tied


def estimated_steps(recipe: Sizable, weights: int) -> dict[str, str]:
    """stage (and eager's evaluation) -> the memory estimate's kind of step: its pass, or one of the estimate's
    own kinds where the pass's peak depends on how it runs (safety/memory_estimate.py)."""
    from optpipe.passes.export import WORKER_MIN_BYTES
    from optpipe.safety.memory_estimate import DECODER_EXPORT, EAGER_APART, EAGER_EVALUATION

    steps = stage_steps(recipe, weights)
    if recipe.evaluate.generation is not None and weights >= WORKER_MIN_BYTES:
        steps = {name: DECODER_EXPORT if kind == "export" else kind for name, kind in steps.items()}
    if recipe.evaluate.eager_baseline:
        # Apart, eager is never beside a stage's runtime: its own evaluation holds one copy, as a stage's does.
        apart = eager_timing(recipe.evaluate.eager_timing, weights) == "apart"
        steps[EAGER] = EAGER_APART if apart else EAGER_EVALUATION
    return steps


def stage_steps(recipe: Sizable, weights: int) -> dict[str, str]:
    """stage -> the memory estimate's kind of step for its pass on weights of this size (any source)."""
    return {name: _step_kind(stage.pass_name, stage.params, weights) for name, stage in recipe.stages.items()}


def _step_kind(pass_name: str, params: dict, weights: int) -> str:
    """A stage's kind of step for the memory estimate: its pass, or how that pass runs on these weights."""
    from optpipe.passes._weight_only_on_disk import WORKER_MIN_BYTES
    from optpipe.safety.memory_estimate import (OV_DATA_AWARE, OV_INT8, TORCHSCRIPT_EXPORT, WEIGHT_ONLY_AWQ, WEIGHT_ONLY_COPY,
                                                WEIGHT_ONLY_WORKER)

    if pass_name == "openvino" and params.get("precision") == "int8":
        return OV_INT8
    if pass_name == "export" and params.get("exporter") == "torchscript":
        return TORCHSCRIPT_EXPORT  # `auto` tries dynamo first, in a worker from 256 MB: the plain export's factor
    if pass_name == "openvino_weights" and params.get("data_aware"):
        return OV_DATA_AWARE
    if pass_name == "weight_only" and params.get("algorithm") == "awq":
        return WEIGHT_ONLY_AWQ  # NNCF's statistics sessions, in its worker whatever the size
    if pass_name == "weight_only" and params.get("algorithm") == "hqq":
        return WEIGHT_ONLY_COPY  # the tied head's float copy (HQQ takes the whole weight), in a worker or not
    if pass_name == "weight_only" and weights >= WORKER_MIN_BYTES:
        return WEIGHT_ONLY_WORKER
    return pass_name


def eager_timing(setting: str, weights: int | None, available: int | None = None) -> str:
    """evaluate.eager_timing resolved: "interleaved" or "apart". auto: interleaved wherever eager's model beside
    a stage's runtime fits this machine's memory (the preflight's estimate of it against MemAvailable, or
    `available`), since only figures from the same seconds compare well on a shared machine (Gemma 3 270M's
    eager, loaded again after each of 8 stages: 57-82 ms a decode step, against 48.9-54.1 ms held beside them, x86-amx);
    apart where it would not fit, so that the model still compiles (docs/memory.md). A source whose size is
    unknown before it loads (a factory, torchvision) stays interleaved."""
    from optpipe.safety.memory_estimate import EAGER_EVALUATION, memory_budget, stage_estimates

    if setting != "auto":
        return setting
    if weights is None:
        return "interleaved"
    need = stage_estimates(weights, {EAGER: EAGER_EVALUATION})[EAGER]
    return "interleaved" if need <= memory_budget(available) else "apart"


def check_generation(recipe: Recipe, onnx_path: Path | None) -> None:
    from optpipe.source.prompts import texts

    spec = recipe.evaluate.generation
    if spec is None:
        return
    vocab = _onnx_vocab(onnx_path) if onnx_path is not None else _torch_vocab(recipe)
    _, max_sequence, _ = decoder_dims(spec, recipe.inputs, recipe.dims, recipe.evaluate.task.tokens)
    if vocab:
        texts(spec, recipe.model_source(), vocab, max_sequence)


def _onnx_vocab(path: Path) -> int | None:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    if not any(value.name.startswith(PAST_PREFIX) for value in graph.input):
        raise RecipeError(f"evaluate.generation: model.onnx '{path.name}' has no past_key_values inputs (it was not exported "
                          f"with a KV cache; inputs: {', '.join(v.name for v in graph.input)}); export the causal LM with "
                          "its cache (model: {hf: FOLDER, task: causal-lm}), or remove evaluate.generation")
    logits = next((v for v in graph.output if v.name == "logits"), None)
    dim = logits.type.tensor_type.shape.dim[-1] if logits is not None and logits.type.tensor_type.shape.dim else None
    return dim.dim_value if dim is not None and dim.HasField("dim_value") else None


def _torch_vocab(recipe: Recipe) -> int | None:
    model = recipe.model
    if isinstance(model, HFConfigModel):
        return model.hf_config.get("vocab_size")
    if isinstance(model, HFModel):
        from optpipe.source.model_source import hf_folder

        return json.loads((hf_folder(recipe.model_source()) / "config.json").read_text()).get("vocab_size")
    return None
