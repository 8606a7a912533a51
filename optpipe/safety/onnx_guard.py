"""Checks on an ONNX file from outside, before anything trusts it.

- it parses as an ONNX model (not another file renamed, not truncated);
- its external-data references stay inside its folder and fit in their files
  (a crafted `location: ../../home/user/.ssh/id_rsa` must not be read);
- its ops exist in the ONNX schemas / ONNX Runtime;
- its inputs match the recipe's input specs (names, dtypes, ranks, fixed dims).

onnx >= 1.17 refuses escaping locations itself when it loads external data; this
module checks first so the user gets one sentence naming the tensor, and so
ONNX Runtime (which reads external data on its own) never sees such a file.

Models over 2 GB cannot be one protobuf: they are checked by path
(`onnx.checker.check_model(path)`), never serialized in memory.
"""
from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from onnx import external_data_helper

from optpipe.core.artifact import all_graphs
from optpipe.core.errors import ModelSourceError, RecipeError, first_line
from optpipe.core.runtime import MASK_NAME, PAST_PREFIX, prefill_feeds
from optpipe.graph.weight_mix import file_uses_bfloat16
from optpipe.safety.file_kinds import other_model_format
from optpipe.recipe.schema import ModelInputs

# Above this size a model cannot be serialized as one protobuf (onnx.checker.MAXIMUM_PROTOBUF, 2 GiB).
PROTOBUF_LIMIT = onnx.checker.MAXIMUM_PROTOBUF
STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
# ONNX Runtime's words for an op it has no kernel for (custom domain / standard domain).
_ORT_UNKNOWN_OP = re.compile(r"(?:[\w.]+:(?P<op>\w+)\(-?\d+\) is not a registered function/op|No Op registered for (?P<op2>\w+))")


def check_model_path(path: Path, where: str) -> None:
    """`path` is a regular file (not a folder, a device or a pipe, which would block a reader)."""
    if path.is_dir():
        raise ModelSourceError(f"{where}: '{path}' is a folder; give the path of the .onnx file in it")
    if path.exists() and not path.is_file():
        raise ModelSourceError(f"{where}: '{path}' is not a regular file (a device or a pipe); give the path of an .onnx file")
    if not path.is_file():
        raise ModelSourceError(f"{where}: file '{path}' does not exist; give the path of an .onnx model")


#: protobuf's limit on one message: no ONNX file (its weights elsewhere) is larger.
MAX_PROTO_BYTES = 2**31


def load_graph(path: Path, where: str) -> onnx.ModelProto:
    """The model without its weights, after checking it is ONNX and its external data is safe."""
    check_model_path(path, where)
    size = path.stat().st_size
    if size == 0:
        raise ModelSourceError(f"{where}: '{path.name}' is empty; export the model again")
    if size > MAX_PROTO_BYTES:  # read whole by onnx.load: a 64 GB file named .onnx would fill the memory first
        raise ModelSourceError(
            f"{where}: '{path.name}' is {size / 2**30:.1f} GiB, over the 2 GiB an ONNX protobuf can hold, so it is no "
            "ONNX model; a large model keeps its weights in external data files beside a small .onnx"
        )
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        other = other_model_format(path)
        if other:
            raise ModelSourceError(f"{where}: '{path.name}' is not ONNX: it is {other}") from None
        raise ModelSourceError(
            f"{where}: '{path.name}' is not an ONNX model or is truncated ({first_line(exc)}); export it again or fix the path"
        ) from None
    if not model.opset_import or not (model.graph.node or model.graph.output):
        raise ModelSourceError(f"{where}: '{path.name}' holds no ONNX graph (not an ONNX file, or truncated); export it again")
    check_external_data(model, path.parent, where)
    return model


def external_locations(model: onnx.ModelProto) -> list[str]:
    return sorted({_location(t) for t in external_data_helper._get_all_tensors(model) if _uses_external(t)})


def model_files(path: Path, model: onnx.ModelProto) -> list[Path]:
    """The ONNX file at `path` and the external-data files beside it that `model` (its graph) names."""
    return [path, *(path.parent / location for location in external_locations(model))]


def external_files(model: onnx.ModelProto, folder: Path) -> dict[str, Path]:
    """Each external-data location of `model` -> its file, for those that stay inside `folder` (see _inside)."""
    return {location: target for location in external_locations(model) if (target := external_file(folder, location)) is not None}


def external_file(folder: Path, location: str) -> Path | None:
    """The file an external-data `location` names in `folder`, or None where it would leave the folder."""
    return _inside(folder.resolve(), location)


def external_bytes(tensor: onnx.TensorProto, folder: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes in `folder`; ValueError where its location leaves the
    folder or names no file (a reader of the bytes by hand: the weight_only worker's sliced table and its save)."""
    info = external_data_helper.ExternalDataInfo(tensor)
    path = external_file(folder, info.location)
    if path is None or not path.is_file():
        raise ValueError(f"tensor '{tensor.name}' reads external data outside its model's folder, or from a missing file")
    offset = info.offset or 0
    return path, offset, info.length if info.length is not None else path.stat().st_size - offset


def check_external_data(model: onnx.ModelProto, folder: Path, where: str) -> None:
    """Every external-data reference names a file inside `folder` that holds the bytes it claims."""
    root = folder.resolve()
    for tensor in external_data_helper._get_all_tensors(model):
        if not _uses_external(tensor):
            continue
        location = _location(tensor)
        target = _inside(root, location)
        if target is None:
            link = " (through a symlink)" if _plain_relative(location) else ""
            raise ModelSourceError(
                f"{where}: tensor '{tensor.name}' points its external data at '{location}', outside the model's "
                f"folder{link}; external data files must sit beside the model"
            )
        if not target.is_file():
            raise ModelSourceError(
                f"{where}: tensor '{tensor.name}' needs external data file '{location}', which is missing; "
                "copy it beside the model"
            )
        info = external_data_helper.ExternalDataInfo(tensor)
        end = (info.offset or 0) + (info.length or 0)
        if end > target.stat().st_size:
            raise ModelSourceError(
                f"{where}: external data file '{location}' is shorter ({target.stat().st_size} bytes) than tensor "
                f"'{tensor.name}' needs ({end}); the file is truncated, copy it again"
            )


# What a user's ONNX file must pass before a stage trusts it, in two parts that preflight runs
# up front (optpipe/safety/preflight.py), so that a file lying about being a usable ONNX model is
# the user's error (exit 2), never a failed stage.


def check_named_parts(path: Path, shapes: ModelInputs, where: str) -> onnx.ModelProto:
    """The cheap checks, on the graph without its weights: it parses, its external data is safe, its
    inputs are the recipe's, its opsets and ops exist."""
    graph = load_graph(path, where)
    check_inputs_match(graph, shapes, path.name)
    check_opsets(graph, path.name, where)
    unknown = unknown_ops(graph)
    if unknown:
        raise ModelSourceError(
            f"{where}: '{path.name}' uses ops that no ONNX schema defines at its opset ({', '.join(unknown)}); "
            "replace them or export with an opset that has them"
        )
    check_deterministic(graph, path.name, where)
    check_tensor_outputs(graph, path.name, where)
    return graph


def check_tensor_outputs(model: onnx.ModelProto, name: str, where: str) -> None:
    """Every output a tensor: a sequence of tensors (SplitToSequence, a scripted module's list) or a map has no
    elements to compare, and every evaluation had failed as "fix the data" (Polygraphy: "dtype is unsupported for
    objects of type: list")."""
    for output in model.graph.output:
        kind = output.type.WhichOneof("value")
        if kind not in (None, "tensor_type"):
            shown = {"sequence_type": "a sequence of tensors", "map_type": "a map", "optional_type": "an optional"}.get(kind, kind)
            raise ModelSourceError(f"{where}: output '{output.name}' of '{name}' is {shown}, not a tensor: optpipe measures "
                                   "tensors; end the graph in a tensor (ConcatFromSequence, SequenceAt), or export the "
                                   "model so that it returns tensors")


#: Ops that draw random numbers at every run (Dropout is not one: ONNX Runtime and OpenVINO run it as inference)
RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")


def check_deterministic(model: onnx.ModelProto, name: str, where: str) -> None:
    """Every stage is measured against the source's own outputs: a graph that samples gives other outputs at
    every run, and its stages came out 'out of tolerance' (OpenVINO's: 'the conversion does not compute what the
    input does') while the export, compared with itself, read cosine 1.0."""
    found = sorted({node.op_type for node in _all_nodes(model.graph) if node.op_type in RANDOM_OPS and node.domain in ("", "ai.onnx")})
    if found:
        raise ModelSourceError(f"{where}: '{name}' draws random numbers ({', '.join(found)}): every stage is measured "
                               "against its outputs, which change at every run; export it without the sampling (eval "
                               "mode, no noise)")


def check_loadable(path: Path, where: str) -> None:
    """The costly checks: onnx.checker's full check (shape and type inference) and an ONNX Runtime session."""
    check_model_file(path, where)
    check_runnable(path, where)


def check_opsets(model: onnx.ModelProto, name: str, where: str) -> None:
    """The standard-domain opset exists: onnx.checker accepts any number, and ONNX Runtime's
    refusal of a future opset reads as a development-build warning."""
    newest = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if (opset.domain or "") in ("", "ai.onnx") and opset.version > newest:
            raise ModelSourceError(
                f"{where}: '{name}' declares opset {opset.version}, newer than any ONNX release this install knows "
                f"(newest: {newest}); export it with opset <= {newest}"
            )


def check_model_file(path: Path, where: str) -> None:
    """onnx.checker's full check (shape and type inference too) on the file.

    By path, whatever its size: a model over 2 GB cannot be one protobuf, and below that the
    path check still spares loading every weight into memory.
    """
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # ValidationError, InferenceError and protobuf errors
        raise ModelSourceError(f"{where}: '{path.name}' is not a valid ONNX model ({first_line(exc)}); export it again") from None


def unknown_ops(model: onnx.ModelProto) -> list[str]:
    """Standard-domain ops that no ONNX schema defines at the model's opset."""
    opsets = {d.domain or "": d.version for d in model.opset_import}
    found = set()
    for node in _all_nodes(model.graph):
        domain = node.domain or ""
        if domain not in STANDARD_DOMAINS:
            continue
        version = opsets.get(domain, opsets.get("ai.onnx" if domain == "" else "", 1))
        try:
            onnx.defs.get_schema(node.op_type, version, domain)
        except onnx.defs.SchemaError:
            found.add(node.op_type if not domain else f"{domain}.{node.op_type}")
    return sorted(found)


def check_runnable(path: Path, where: str) -> None:
    """ONNX Runtime can build a session for the model; else name the op it cannot run."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # FATAL only: a failure raises, and optpipe reports its message
    try:
        ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT's own exception types
        message = first_line(exc, limit=2000)
        op = _ORT_UNKNOWN_OP.search(message)
        if op:
            raise ModelSourceError(
                f"{where}: ONNX Runtime cannot run op '{op.group('op') or op.group('op2')}' in '{path.name}' (no kernel is registered for it); "
                "replace the op or export with ops ONNX Runtime implements"
            ) from None
        detail = message.split("failed:", 1)[-1].strip()[:300]
        if "Could not find an implementation" in message and file_uses_bfloat16(path):
            raise ModelSourceError(f"{where}: ONNX Runtime cannot load '{path.name}' ({detail}): it computes in bfloat16, "
                                   "which ONNX Runtime's CPU kernels mostly do not run; export it in float32 (the stages "
                                   "take the lower precisions themselves: fp16, openvino bf16)") from None
        raise ModelSourceError(f"{where}: ONNX Runtime cannot load '{path.name}' ({detail}); export the model again") from None


def check_runs_on(path: Path, feeds: dict, where: str = "model.onnx") -> None:
    """ONNX Runtime runs the model on `feeds` (built from the recipe's input specs); else the
    specs do not fit the model: RecipeError naming the inputs' range and dims."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the cheapest session: one run
    options.log_severity_level = 4  # FATAL only: a failure raises, and optpipe reports its message
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        session.run(None, prefill_feeds(feeds, [(i.name, list(i.shape)) for i in session.get_inputs()]))
    except Exception as exc:  # ORT's own exception types: a Gather index out of range, a Reshape that cannot fit
        detail = first_line(exc, limit=2000).split("Status Message:", 1)[-1].strip()[:300]
        shapes = ", ".join(f"{name} {list(value.shape)}" for name, value in feeds.items())
        raise RecipeError(
            f"inputs: '{path.name}' fails on inputs built from the recipe's input specs ({shapes}): {detail}; "
            "set the inputs' `range` and `dims` to what the model accepts"
        ) from None


def check_inputs_match(model: onnx.ModelProto, shapes: ModelInputs, where: str) -> None:
    """The recipe's input specs describe the model's graph inputs: names, dtypes, ranks, fixed dims."""
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    declared = {spec.name for spec in shapes.inputs}
    if any(name.startswith(PAST_PREFIX) for name in graph_inputs):  # a KV-cache decoder: the recipe names its tokens;
        graph_inputs = {n: i for n, i in graph_inputs.items()  # the mask and the past are the generation loop's
                        if n in declared or not (n.startswith(PAST_PREFIX) or n == MASK_NAME)}
    if set(graph_inputs) != declared:
        raise ModelSourceError(
            f"inputs: the recipe declares {sorted(declared)} but '{where}' takes {sorted(graph_inputs)}; "
            "make the recipe's input names match"
        )
    for i, spec in enumerate(shapes.inputs):
        tensor = graph_inputs[spec.name].type.tensor_type
        if tensor.elem_type:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
            if dtype != spec.dtype:
                raise ModelSourceError(f"inputs.{i}.dtype: the model's input '{spec.name}' is {dtype}, the recipe says {spec.dtype}; set `dtype: {dtype}`")
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if len(dims) != len(spec.shape):
            raise ModelSourceError(
                f"inputs.{i}.shape: the model's input '{spec.name}' has rank {len(dims)}, the recipe's shape "
                f"{spec.shape} has {len(spec.shape)}; give one entry per axis"
            )
        for axis, (dim, want) in enumerate(zip(dims, spec.shape)):
            if not dim.HasField("dim_value"):
                continue
            sizes = {want} if isinstance(want, int) else {shapes.dims[want].min, shapes.dims[want].max}
            if sizes != {dim.dim_value}:
                raise ModelSourceError(
                    f"inputs.{i}.shape: the model fixes axis {axis} of '{spec.name}' to {dim.dim_value}, the recipe "
                    f"gives {want!r}; set it to {dim.dim_value}"
                )


def _uses_external(tensor: onnx.TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL


def _location(tensor: onnx.TensorProto) -> str:
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def _plain_relative(location: str) -> bool:
    """A relative path without `..`, backslashes or NULs (it may still be a symlink)."""
    relative = PurePosixPath(location)
    return bool(location) and "\\" not in location and "\0" not in location and not relative.is_absolute() and ".." not in relative.parts


def _inside(root: Path, location: str) -> Path | None:
    """The resolved file for `location` if it stays inside `root` (no absolute path, no `..`, no symlink out)."""
    if not _plain_relative(location):
        return None
    target = (root / PurePosixPath(location)).resolve()
    return target if target.is_relative_to(root) else None


def _all_nodes(graph: onnx.GraphProto):
    return (node for sub in all_graphs(graph) for node in sub.node)
