"""simplify: constant folding and redundant-node removal with onnxslim or onnxsim (self-checked against its input)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.core.errors import PassError
from optpipe.graph.stats import graph_stats, op_changes
from optpipe.pass_infra.pass_base import Pass, PassContext


class SimplifyParams(SelfCheckParams):
    backend: Literal["onnxslim", "onnxsim"] = Field("onnxslim", description="simplifier library")


class SimplifyPass(Pass[SimplifyParams]):
    """Fold constants and remove redundant nodes (onnxslim or onnxsim); dynamic dims are kept."""

    name = "simplify"
    version = "1"
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
        source = model.load()
        before = graph_stats(source)
        try:
            simplified = _simplify(source, params.backend)
        except PassError:
            raise
        except Exception as exc:  # both libraries raise assorted errors on graphs they cannot handle
            ctx.log.exception("simplify failed")
            other = "onnxsim" if params.backend == "onnxslim" else "onnxslim"
            raise PassError(f"{params.backend} failed: {str(exc).splitlines()[0][:200]}; try `backend: {other}`") from None
        artifact = save_model(simplified, ctx.workdir)
        after = graph_stats(artifact.load(with_weights=False))
        info = {
            "backend": params.backend,
            "nodes_before": before["nodes"],
            "nodes_after": after["nodes"],
            "op_changes": op_changes(before["ops"], after["ops"]),
            "graph": after,
        }
        return write_info(ctx.workdir, info)


def _simplify(model, backend: str):
    if backend == "onnxslim":
        import onnxslim

        return onnxslim.slim(model)
    import onnxsim

    simplified, ok = onnxsim.simplify(model)
    if not ok:
        raise PassError("onnxsim could not verify its result; try `backend: onnxslim`")
    return simplified
