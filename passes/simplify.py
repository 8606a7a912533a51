"""simplify: constant folding and redundant-node removal with onnxslim or onnxsim (self-checked against its input)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.core.errors import PassError
from optpipe.graph.stats import graph_stats, op_changes
from optpipe.pass_infra.pass_base import Pass, PassContext
from optpipe.pass_infra.progress import Progress, Steps, logged_progress, printed_progress


class SimplifyParams(SelfCheckParams):
    backend: Literal["onnxslim", "onnxsim"] = Field("onnxslim", description="simplifier library")


class SimplifyPass(Pass[SimplifyParams]):
    """Fold constants and remove redundant nodes (onnxslim or onnxsim); dynamic dims are kept."""

    name = "simplify"
    version = "2"  # 2: onnxslim gets the shapes inferred on the graph alone (less memory; same simplification)
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
        steps = Steps(ctx.progress, "simplify", 4 if params.backend == "onnxslim" else 3)
        steps("load the model")
        source, shapes = _with_shapes(model, params.backend, ctx, steps)
        before = graph_stats(source)
        steps(params.backend)
        try:
            simplified = _simplify(source, params.backend, steps.progress, ctx.log, shapes == "graph-only")
        except PassError:
            raise
        except Exception as exc:  # both libraries raise assorted errors on graphs they cannot handle
            ctx.log.exception("simplify failed")
            other = "onnxsim" if params.backend == "onnxslim" else "onnxslim"
            raise PassError(f"{params.backend} failed: {str(exc).splitlines()[0][:200]}; try `backend: {other}`") from None
        steps("save the model")
        artifact = save_model(simplified, ctx.workdir)
        after = graph_stats(artifact.load(with_weights=False))
        info = {
            "backend": params.backend,
            "nodes_before": before["nodes"],
            "nodes_after": after["nodes"],
            "op_changes": op_changes(before["ops"], after["ops"]),
            "graph": after,
        }
        if shapes:
            info["shape_inference"] = shapes
        return write_info(ctx.workdir, info)


#: Initializers up to this size are read for the graph-only shape inference: shape constants, biases, norms.
SHAPE_TENSOR_BYTES = 1 << 20


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
    inferred = _graph_only_shapes(model.path, ctx)
    source = model.load()
    if inferred is None:
        return source, "onnxslim"
    del source.graph.value_info[:]
    source.graph.value_info.extend(inferred.graph.value_info)
    return source, "graph-only"


def _graph_only_shapes(path, ctx: PassContext):
    import onnx
    from onnx import external_data_helper
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    from onnxslim.core import AUTO_MERGE  # the setting onnxslim's own inference runs with

    graph = onnx.load(str(path), load_external_data=False)
    for tensor in graph.graph.initializer:
        if external_data_helper.uses_external_data(tensor):
            length = int(next((e.value for e in tensor.external_data if e.key == "length"), 0) or 0)
            if length < SHAPE_TENSOR_BYTES:
                external_data_helper.load_external_data_for_tensor(tensor, str(path.parent))
            # A held-out weight keeps its dims and no data: reading it raises, never a file of that name
            # in the working directory (onnx resolves a tensor's location there when not told the folder).
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    try:
        return SymbolicShapeInference.infer_shapes(graph, auto_merge=AUTO_MERGE)
    except Exception as exc:  # it read a weight held out (or cannot infer this graph): onnxslim's own way
        ctx.log.info("graph-only shape inference failed (%s); onnxslim infers the shapes on the whole model", exc)
        return None


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
