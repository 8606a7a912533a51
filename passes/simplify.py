"""simplify: constant folding and redundant-node removal with onnxslim or onnxsim (self-checked against its input)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import onnx
from pydantic import Field

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.core.errors import PassError, first_line
from optpipe.graph.stats import graph_stats, op_changes
from optpipe.pass_infra.pass_base import Pass, PassContext
from optpipe.pass_infra.progress import Progress, Steps, logged_progress, printed_progress
from optpipe.passes import _onnxslim_on_disk


class SimplifyParams(SelfCheckParams):
    backend: Literal["onnxslim", "onnxsim"] = Field("onnxslim", description="simplifier library")


class SimplifyPass(Pass[SimplifyParams]):
    """Fold constants and remove redundant nodes (onnxslim or onnxsim); dynamic dims are kept."""

    name = "simplify"
    version = "3"  # 2: onnxslim gets the shapes inferred on the graph alone; 3: weights on disk in a worker for big models
    Params = SimplifyParams
    libraries = ("onnx", "onnxslim", "onnxsim")
    check_hint = "try the other backend"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        from optpipe.safety.onnx_guard import PROTOBUF_LIMIT

        if params.backend == "onnxsim" and model.size_bytes() >= PROTOBUF_LIMIT:
            # onnxsim serializes the whole model as one protobuf, which cannot exceed 2 GB; onnxslim
            # goes through external data for large models.
            raise PassError("onnxsim cannot simplify a model over 2 GB (one protobuf); use `backend: onnxslim`")
        on_disk = params.backend == "onnxslim" and model.size_bytes() >= _onnxslim_on_disk.WORKER_MIN_BYTES
        steps = Steps(ctx.progress, "simplify", 2 if on_disk else 4 if params.backend == "onnxslim" else 3)
        before = graph_stats(model.load(with_weights=False))
        artifact, how = None, {}
        if on_disk:  # a fallback in memory adds its steps to the count
            artifact, how = _slim_on_disk(model, ctx, steps)
        if artifact is None:
            artifact, shapes = _simplify_in_memory(model, params.backend, ctx, steps)
            how.update({"weights": "in memory"} if params.backend == "onnxslim" else {})
            how.update({"shape_inference": shapes} if shapes else {})
        after = graph_stats(artifact.load(with_weights=False))
        info = {
            "backend": params.backend,
            "nodes_before": before["nodes"],
            "nodes_after": after["nodes"],
            "op_changes": op_changes(before["ops"], after["ops"]),
            "graph": after,
            **how,
        }
        return write_info(ctx.workdir, info)


def _slim_on_disk(model: ModelArtifact, ctx: PassContext, steps: Steps) -> tuple[ModelArtifact | None, dict]:
    """onnxslim in a worker reading the weights from disk (passes/_onnxslim_on_disk.py): the model's
    artifact and how it was made, or None when the worker failed (the in-memory path then runs, and the
    stage info says why it did)."""
    steps("onnxslim, weights on disk (worker)")
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as scratch:
        try:
            result = _onnxslim_on_disk.slim_on_disk(model.path, ctx.workdir, Path(scratch))
        except _onnxslim_on_disk.DiskWorkerFailed as exc:
            ctx.log.warning("onnxslim on disk failed (%s); onnxslim runs on the loaded model", exc)
            return None, {"on_disk_failed": str(exc)}
    steps("save the model")  # the worker saved it
    return ModelArtifact(folder=ctx.workdir, info={}), {"weights": "on disk (worker)", **result}


def _simplify_in_memory(model: ModelArtifact, backend: str, ctx: PassContext, steps: Steps) -> tuple[ModelArtifact, str | None]:
    steps("load the model")
    try:
        source, shapes = _with_shapes(model, backend, ctx, steps)
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:  # a truncated or missing data file
        raise PassError(f"cannot read the input model: {first_line(exc, 200)}") from None
    steps(backend)
    try:
        simplified = _simplify(source, backend, steps.progress, ctx.log, shapes == "graph-only")
    except PassError:
        raise
    except Exception as exc:  # both libraries raise assorted errors on graphs they cannot handle
        ctx.log.exception("simplify failed")
        other = "onnxsim" if backend == "onnxslim" else "onnxslim"
        raise PassError(f"{backend} failed: {str(exc).splitlines()[0][:200]}; try `backend: {other}`") from None
    del source
    steps("save the model")
    return save_model(simplified, ctx.workdir), shapes


def _with_shapes(model: ModelArtifact, backend: str, ctx: PassContext, steps: Steps):
    """The input, loaded, and for onnxslim with its tensor shapes already inferred on the graph alone.

    onnxslim runs ONNX Runtime's symbolic shape inference on the whole model, weights included, and
    that copies the model twice: on BERT-base (438 MB) its simplify peaked at +2.6 GB above the loaded
    model, +1.45 GB when the same inference ran on the graph with only its tensors under 1 MiB loaded
    (shape constants, biases), for the same 458 nodes out (measured, bench/memory.py; docs/memory.md).
    The weight matrices' bytes are not what the inference reads. Where it needs one (it raises), onnxslim
    infers the shapes itself, as before: "onnxslim" in the stage info."""
    if backend != "onnxslim":
        return model.load(), None
    steps("shape inference on the graph")
    graph = _held_out_graph(model.path)
    source = model.load()
    failed = _onnxslim_on_disk.infer_shapes_into(source, graph)
    if failed:
        ctx.log.info("graph-only shape inference failed (%s); onnxslim infers the shapes on the whole model", failed)
    return source, "onnxslim" if failed else "graph-only"


def _held_out_graph(path) -> onnx.ModelProto:
    """The graph with its tensors under 1 MiB loaded and the rest held out: dims kept, no data."""
    from onnx import external_data_helper

    graph = _onnxslim_on_disk.graph_with_small_tensors(path)
    for tensor in graph.graph.initializer:
        if external_data_helper.uses_external_data(tensor):
            # A held-out weight keeps its dims and no data: reading it raises, never a file of that name
            # in the working directory (onnx resolves a tensor's location there when not told the folder).
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return graph


def _simplify(model, backend: str, progress: Progress, log, shapes_inferred: bool = False):
    if backend == "onnxslim":
        return _onnxslim(model, progress, log, shapes_inferred)
    # onnxsim has no progress of its own (one C++ call): the console's heartbeat shows its time.
    import onnxsim

    simplified, ok = onnxsim.simplify(model)
    if not ok:
        raise PassError("onnxsim could not verify its result; try `backend: onnxslim`")
    return simplified


def _onnxslim(model, progress: Progress, log, shapes_inferred: bool = False):
    """onnxslim.slim with its own progress: `verbose=True` makes it log each phase on the "onnxslim"
    logger (iterations, constant folding, shape inference; the longest gap between two measured 1.8 s
    on MiniLM at load 9), which become this stage's steps. It also turns its bundled graphsurgeon's
    debug prints on: they go to the stage log, and its severity is put back afterwards."""
    import onnxslim
    from onnxslim import utils as slim_utils

    severity = slim_utils.G_LOGGER.severity
    try:
        with logged_progress(progress, "onnxslim", "onnxslim", log), printed_progress(progress, "onnxslim", None, log):
            return onnxslim.slim(model, verbose=True, no_shape_infer=shapes_inferred)
    finally:
        slim_utils.G_LOGGER.severity = severity
