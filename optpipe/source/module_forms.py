"""What a factory may return beside a plain nn.Module: how each is exported, or one line saying why it cannot be.

A TorchScript module made by torch.jit.trace exports like any module (the tracer runs through it). One made by
torch.jit.script, or read back by torch.jit.load (how TorchScript models ship), cannot be traced inside optpipe's
output wrapper: both exporters failed on it with unrelated lines ("takes 2 positional arguments but 3 were given";
"Tried to trace ... but it is not part of the active trace"). torch.onnx's TorchScript exporter takes it whole, so
it is exported as it is where its outputs need no wrapper (a tensor or a tuple of tensors, all kept)."""
from __future__ import annotations

from optpipe.core.errors import ModelSourceError


def refuse_unexportable(net, where: str) -> None:
    """A factory's result that no exporter takes, refused in one line naming `where` it came from: an ExportedProgram,
    a module that cannot be put in eval mode, one quantized by torch.ao already (init had read no input from its packed
    layers and guessed an image)."""
    import torch

    from optpipe.source.checkpoint_precision import refuse_quantized_modules

    if isinstance(net, torch.export.ExportedProgram):
        raise ModelSourceError(f"{where} returned a torch.export ExportedProgram, not a module: return the nn.Module it was "
                               "exported from")
    try:
        getattr(net, "eval", lambda: None)()
    except NotImplementedError as exc:  # torch.export's .module(): "Calling eval() is not supported yet."
        raise ModelSourceError(f"{where} returned a {type(net).__name__} that cannot be put in eval mode ({exc}), as "
                               "torch.export's .module() is: return the nn.Module it was exported from") from None
    if isinstance(net, torch.nn.Module):
        refuse_quantized_modules(net, where)


def layer_kind(module) -> str:
    """A layer's torch.nn class name: a traced module's (torch.jit.trace keeps it as `original_name`), and a subclass's
    (a LoRA `Linear`, or the `ParametrizedLinear` that weight_norm makes) by the torch.nn layer it extends."""
    traced = getattr(module, "original_name", None)
    if traced:
        return traced
    return next((c.__name__ for c in type(module).__mro__ if c.__module__.startswith("torch.nn.modules.")),
                type(module).__name__)


def is_scripted(net) -> bool:
    """A torch.jit.script module, or one torch.jit.load read: the TorchScript exporter takes it whole, dynamo not at all."""
    import torch

    return isinstance(net, torch.jit.ScriptModule) and not isinstance(net, torch.jit.TopLevelTracedModule)


def scripted_as_is(net, returned, indices: list[int]) -> bool:
    """A scripted module is exported as it is: true where it returns a tensor or a tuple of tensors, every one kept.
    Else (a dict, nested outputs, `model.outputs` picking some) it is refused: the wrapper that would pick them is
    what the exporters cannot trace through."""
    import torch

    if not is_scripted(net):
        return False
    flat = isinstance(returned, torch.Tensor) or (isinstance(returned, (tuple, list)) and
                                                   all(isinstance(t, torch.Tensor) for t in returned))
    count = 1 if isinstance(returned, torch.Tensor) else len(returned) if flat else -1
    if flat and indices == list(range(count)):
        return True
    raise ModelSourceError(
        "model: a TorchScript module (torch.jit.script, or torch.jit.load of a saved one) is exported as it is, which "
        "takes a tensor or a tuple of tensors returned, all kept: it returns another structure or `model.outputs` picks "
        "some; return a tuple of the tensors to export from its forward, or the nn.Module it was made from")


def load_torchscript(path, where: str = "model.torchscript"):
    """A TorchScript archive (torch.jit.save) as its module, on the CPU; another file (a torch.save checkpoint, an npz)
    is named by what it is (safety/file_kinds.py), with the recipe that takes it."""
    import torch

    from optpipe.safety.file_kinds import is_torchscript_archive, other_model_format

    if not path.is_file():
        what = "is a folder; give the file torch.jit.save wrote" if path.is_dir() else "does not exist; fix the path"
        raise ModelSourceError(f"{where}: '{path}' {what}")
    if not is_torchscript_archive(path):
        raise ModelSourceError(f"{where}: '{path.name}' is not a TorchScript archive: it is "
                               f"{other_model_format(path) or 'no model file optpipe knows'}")
    try:
        return torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # torch's own RuntimeError for a damaged archive
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ModelSourceError(f"{where}: '{path.name}' is not a readable TorchScript archive ({first[:160]}); "
                               "save the module with torch.jit.save") from None


def forward_parameters(forward) -> list[tuple[str, bool]]:
    """(name, required) for each named parameter of forward(), in order (no *args/**kwargs)."""
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    schema = getattr(forward, "schema", None)
    if schema is not None:  # a TorchScript module's forward: a ScriptMethod, whose schema names the module first
        return [(a.name, not a.has_default_value()) for a in schema.arguments[1:]]
    params = inspect.signature(forward).parameters.values()
    return [(p.name, p.default is inspect.Parameter.empty) for p in params if p.kind in kinds and p.name != "self"]


def input_binding(net, names: list[str], where: str):
    """How forward() takes the recipe's inputs: by keyword where every input is named after one of its parameters (the
    recipe may list them in any order), else in the recipe's order. Fed in that order, a recipe listing [mask, ids] for
    forward(ids, mask) gave the mask as the token ids; every stage matched that wrong model, "ok" at cosine 1.0. An
    input named after a parameter at another position is refused where keywords cannot help: a TorchScript module is
    exported as it is, its inputs in the recipe's order."""
    try:
        params = [name for name, _ in forward_parameters(net.forward)]
    except (TypeError, ValueError):  # no signature to read: the recipe's order, as before
        return positional
    # A keyword-only parameter (forward(self, *, x)) takes no position: in forward()'s order, it still goes by name.
    in_order = names == params[:len(names)] and not _keyword_only(net.forward) & set(names)
    if in_order or not set(names) <= set(params):
        misplaced = [n for i, n in enumerate(names) if n in params and params.index(n) != i]
        if misplaced:
            raise ModelSourceError(f"inputs: '{misplaced[0]}' is parameter {params.index(misplaced[0]) + 1} of {where}'s "
                                   f"forward({', '.join(params)}) but input {names.index(misplaced[0]) + 1} of the recipe, "
                                   "which feeds inputs in its order; list `inputs` in forward()'s order")
        return positional
    if is_scripted(net):
        raise ModelSourceError(f"inputs: the recipe lists {', '.join(names)}, {where}'s forward takes "
                               f"({', '.join(params)}); a TorchScript module is exported with its inputs in the recipe's "
                               "order: list `inputs` in forward()'s order")
    return lambda model, *args: model(**dict(zip(names, args)))


def _keyword_only(forward) -> set[str]:
    import inspect

    if getattr(forward, "schema", None) is not None:  # a TorchScript method: positional as exported
        return set()
    return {p.name for p in inspect.signature(forward).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def positional(model, *args):
    return model(*args)
