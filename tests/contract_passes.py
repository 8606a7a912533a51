"""Passes that break (or test) the pass contract, loaded through OPTPIPE_PLUGINS by test_pass_contract.py."""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from optpipe.core.artifact import ModelArtifact, save_model
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams


class StrayParams(PassParams):
    stray: str = "notes.txt"


class StrayFilePass(Pass[StrayParams]):
    """Copies its input and leaves a scratch file beside the model."""

    name = "contract-stray"
    Params = StrayParams

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        artifact = save_model(model.load(), ctx.workdir)
        (ctx.workdir / self.params.stray).write_text("scratch")
        return artifact


class MutateInputPass(Pass):
    """Writes its result, then edits its input's weights in place."""

    name = "contract-mutate"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        artifact = save_model(model.load(), ctx.workdir)
        with open(model.folder / "model.onnx.data", "r+b") as fh:
            fh.write(b"\x00\x00\x80\x7f")  # the first float becomes +inf
        return artifact


class WrongReturnPass(Pass):
    """Writes its result but returns its input artifact."""

    name = "contract-wrong-return"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        save_model(model.load(), ctx.workdir)
        return model


class ScaleByDataPass(Pass):
    """Scales the first weight by the mean of the evaluation set: its output depends on the data."""

    name = "contract-scale-by-data"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        samples = ctx.eval_set()
        factor = 1.0 + abs(float(np.mean(next(iter(samples.arrays.values()))))) * 1e-6
        proto = model.load()
        init = proto.graph.initializer[0]
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), init.name))
        return save_model(proto, ctx.workdir, {"factor": factor})


class NoisyParams(SelfCheckParams):
    scale: float = 0.5


class NoisyPass(Pass[NoisyParams]):
    """Adds noise to every float weight: a pass that breaks numerics, for the self-check."""

    name = "contract-noisy"
    Params = NoisyParams

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        proto = model.load()
        rng = np.random.default_rng(0)
        for init in proto.graph.initializer:
            array = numpy_helper.to_array(init)
            if array.dtype == np.float32 and array.size > 1:
                noisy = array + rng.normal(0, self.params.scale, array.shape).astype(np.float32)
                init.CopyFrom(numpy_helper.from_array(noisy, init.name))
        return save_model(proto, ctx.workdir, {"scale": self.params.scale})
