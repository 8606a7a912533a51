"""Evaluation in two phases: every stage's accuracy and headline latency, then the sweep curves for
the stages that get them (the Pareto frontier and the eager baseline by default, every stage when
`evaluate.sweep_stages: all`)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from optpipe.core.artifact import save_model
from optpipe.pass_infra.pass_base import Pass, PassParams
from optpipe.passes import register_pass, unregister_pass
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe

SWEEP = {"batch": [1, 2, 8]}


class NoiseParams(PassParams):
    scale: float = 0.5


class NoisePass(Pass):
    """Adds noise to every weight: a stage out of tolerance, never on the frontier."""

    name = "test-sweep-noise"
    Params = NoiseParams

    def run(self, model, ctx):
        proto = model.load()
        rng = np.random.default_rng(0)
        for init in proto.graph.initializer:
            array = numpy_helper.to_array(init)
            if array.dtype == np.float32 and array.size > 1:
                init.CopyFrom(numpy_helper.from_array(array + rng.normal(0, self.params.scale, array.shape).astype(np.float32), init.name))
        return save_model(proto, ctx.workdir, {})


@pytest.fixture(autouse=True)
def noise_pass():
    register_pass(NoisePass)
    yield
    unregister_pass(NoisePass.name)


def _swept(report) -> set[str]:
    return {s.name for s in report.stages if any(lat.sweep for lat in s.latency)}


def _recipe(tiny_recipe, **evaluate):
    stages = {"noisy": {"pass": "test-sweep-noise", "after": "simplify"}}
    return load_recipe(tiny_recipe({"stages": stages, "evaluate": {"sweep": SWEEP, "sweep_iterations": 3, **evaluate}}))


def test_sweeps_only_the_frontier_by_default_then_every_stage_when_asked(tiny_recipe, cache_dir, tmp_path):
    report = compile_recipe(_recipe(tiny_recipe), RunOptions(cache_dir=cache_dir))
    assert not report.stage("noisy").accuracy.within_tolerance
    assert report.pareto and "noisy" not in report.pareto
    assert _swept(report) == set(report.pareto) | {"pytorch-eager"}
    headline = {s.name: [lat.model_dump() for lat in s.latency if lat.sweep is None] for s in report.stages}
    for name in _swept(report):
        points = report.stage(name).sweep("batch")
        assert [p.sweep_value for p in points] == [1, 2, 8] and [p.batch_size for p in points] == [1, 2, 8]
        # The batch-1 point is on the headline's very inputs: that figure, not a second timing.
        assert points[0].p50_ms == report.stage(name).headline.p50_ms and points[0].eager_p50_ms is None
    markdown = (tmp_path / "run" / "report.md").read_text()
    assert "noisy (not on the Pareto frontier)" in markdown
    assert "noisy (not on the Pareto frontier)" in (tmp_path / "run" / "report.html").read_text()

    # Asking for every stage measures only the missing sweeps: accuracy and headlines come from the cache.
    again = compile_recipe(_recipe(tiny_recipe, sweep_stages="all"), RunOptions(cache_dir=cache_dir))
    assert _swept(again) == {s.name for s in again.stages if s.status == "ok"}
    assert {s.name: [lat.model_dump() for lat in s.latency if lat.sweep is None] for s in again.stages} == headline
    assert [s.pareto for s in again.stages] == [s.pareto for s in report.stages]
    assert "None for" not in (tmp_path / "run" / "report.md").read_text()
    from optpipe.reporting.html import sweep_note

    assert sweep_note(again.model_copy(update={"evaluation": {**again.evaluation, "sweep": {}}})) is None
