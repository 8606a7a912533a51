"""What a factory may return that looks like a model but is no module the exporters can trace: one line each, with
the way out. A TorchScript module made by torch.jit.trace exports (the tracer runs through it); one made by
torch.jit.script, or read back by torch.jit.load, does not: both exporters failed on it with two unrelated lines
("takes 2 positional arguments but 3 were given"; "Tried to trace ... but it is not part of the active trace")."""
from __future__ import annotations

from optpipe.core.errors import ModelSourceError


def refuse_unexportable(net, where: str) -> None:
    import torch

    if isinstance(net, torch.export.ExportedProgram):
        raise ModelSourceError(f"{where} returned a torch.export ExportedProgram, not a module: return the nn.Module it was "
                               "exported from")
    try:
        getattr(net, "eval", lambda: None)()
    except NotImplementedError as exc:  # torch.export's .module(): "Calling eval() is not supported yet."
        raise ModelSourceError(f"{where} returned a {type(net).__name__} that cannot be put in eval mode ({exc}), as "
                               "torch.export's .module() is: return the nn.Module it was exported from") from None
    if isinstance(net, torch.jit.ScriptModule) and not isinstance(net, torch.jit.TopLevelTracedModule):
        raise ModelSourceError(
            f"{where} returned a TorchScript module (torch.jit.script, or torch.jit.load of a saved one), which the "
            "exporters cannot trace through: return the nn.Module it was made from (or torch.jit.trace of it), or export "
            "it to ONNX yourself and give `model: {onnx: FILE}`")


def layer_kind(module) -> str:
    """A layer's class name, a traced module's included (torch.jit.trace keeps it as `original_name`)."""
    return getattr(module, "original_name", None) or type(module).__name__
