"""The two torch.onnx exporters as the export pass calls them (passes/export.py): dynamo with the
recipe's dims as torch.export Dims, and the TorchScript tracer with dynamic axes. Each writes
`model.onnx` + its data; the pass checks the result against eager."""
from __future__ import annotations

import logging
from pathlib import Path

from optpipe.core.runtime import torch_inputs
from optpipe.pass_infra.progress import Progress, native_stdout_to, no_progress, printed_progress
from optpipe.recipe.schema import DimRange, ModelInputs
from optpipe.source.model_source import TorchModel

DYNAMO_MIN_OPSET = 18
TORCHSCRIPT_MAX_OPSET = 20  # torch.onnx's TorchScript exporter writes no later opset


def dynamic_dims(shapes: ModelInputs) -> dict[str, dict[int, str]]:
    return {spec.name: {axis: dim for axis, dim in enumerate(spec.shape) if isinstance(dim, str)} for spec in shapes.inputs}


def export_dynamo(torch_model: TorchModel, feeds, shapes: ModelInputs, opset: int, path: Path,
                  progress: Progress = no_progress, log: logging.Logger | None = None) -> None:
    """`progress`: the exporter's own phases ("Obtain model graph ...", "Run decompositions...",
    "Translate the graph into ONNX...", "Optimize the ONNX graph..."), which it prints with
    `verbose=True`: each printed line is a step, none reaches the terminal (the stage log keeps them)."""
    import torch

    dims = {name: export_dim(name, d) for name, d in shapes.dims.items()}
    dynamic = tuple({axis: dims[dim] for axis, dim in axes.items()} or None for axes in dynamic_dims(shapes).values())
    args = torch_inputs(feeds, torch_model.input_names)
    if takes_varargs(torch_model.module):
        dynamic = (dynamic,)  # forward(*args): the spec of the one `args` parameter is the whole tuple
    quiet_exporter()
    with printed_progress(progress, "torch.onnx dynamo", "[torch.onnx]", log):
        program = torch.onnx.export(
            torch_model.module,
            args,
            dynamo=True,
            opset_version=opset,
            input_names=torch_model.input_names,
            output_names=torch_model.output_names,
            dynamic_shapes=dynamic,
            verbose=True,
        )
    program.save(str(path), external_data=True)
    name_derived_dims(path, shapes)


def export_dim(name: str, dim):
    """A torch.export Dim for a recipe dim; `multiple_of: N` becomes the derived dim N * k, so the
    exporter knows every size is a multiple (a detector's Concat of strided maps then lines up)."""
    import torch

    if not dim.multiple_of:
        return torch.export.Dim(name, min=max(1, dim.min), max=dim.max)
    n = dim.multiple_of
    return n * torch.export.Dim(f"{name}_div", min=dim.min // n, max=dim.max // n)


def name_derived_dims(path: Path, shapes: ModelInputs) -> None:
    """Derived dims come out named "32*h_div": give them the recipe's name `h` again, wherever they appear."""
    import onnx

    names = {f"{d.multiple_of}*{name}_div": name for name, d in shapes.dims.items() if d.multiple_of}
    if not names:
        return
    model = onnx.load(str(path), load_external_data=False)  # the weights stay in their file
    graph = model.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]
    onnx.save(model, str(path))


def export_torchscript(torch_model: TorchModel, feeds, shapes: ModelInputs, opset: int, path: Path,
                       log: logging.Logger | None = None) -> list[str]:
    """Trace and export; returns the tracer's warnings about tensors turned into Python booleans
    (control flow that the trace fixes to the branch the trace inputs took)."""
    import warnings

    import torch

    args = torch_inputs(feeds, torch_model.input_names)
    dynamic_axes = {name: axes for name, axes in dynamic_dims(shapes).items() if axes}
    batch = shapes.batch_dim()
    if batch:  # the tracer names no output dim itself; the outputs that are one row per sample share the batch dim
        dynamic_axes.update({out: {0: batch} for out in batch_led_outputs(torch_model, feeds, shapes.dims[batch])})
    with warnings.catch_warnings(record=True) as caught, native_stdout_to(log):
        warnings.simplefilter("always", torch.jit.TracerWarning)
        torch.onnx.export(
            torch_model.module,
            args,
            str(path),
            dynamo=False,
            opset_version=min(opset, TORCHSCRIPT_MAX_OPSET),
            input_names=torch_model.input_names,
            output_names=torch_model.output_names,
            dynamic_axes=dynamic_axes,
        )
    return [str(w.message).split(".")[0] for w in caught if "Python boolean" in str(w.message)]


def batch_led_outputs(torch_model: TorchModel, feeds, batch: DimRange) -> list[str]:
    """The outputs whose first dim follows the batch, in eager runs at the trace's batch and one more (or one fewer).
    Labelled by name without looking, a mean over the batch ([8]) or a length that depends on the data (the scores
    past a threshold) came out as [batch]: the graph lied about its shapes, and Triton batched requests into them."""
    import numpy as np
    import torch

    size = len(next(iter(feeds.values())))
    other = size + 1 if size + 1 <= batch.max else size - 1
    if other < max(batch.min, 1):
        return list(torch_model.output_names)  # one batch size only: nothing to tell apart, nothing to batch
    resized = {name: np.concatenate([a, a[:1]]) if other > size else a[:other] for name, a in feeds.items()}
    leads = []
    with torch.no_grad():
        for feed in (feeds, resized):
            outs = torch_model.module(*torch_inputs(feed, torch_model.input_names))
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)  # a TorchScript module returning one tensor
            leads.append([o.dim() > 0 and o.shape[0] == len(next(iter(feed.values()))) for o in outs])
    return [name for name, *led in zip(torch_model.output_names, *leads) if all(led)]


def takes_varargs(module) -> bool:
    import inspect

    params = list(inspect.signature(module.forward).parameters.values())
    return len(params) == 1 and params[0].kind is inspect.Parameter.VAR_POSITIONAL


def quiet_exporter() -> None:
    for name in ("torch.onnx", "torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(name).setLevel(logging.ERROR)
