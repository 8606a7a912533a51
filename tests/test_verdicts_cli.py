"""--force measures again; `optpipe export` refuses an out-of-tolerance stage unless allowed."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from optpipe.core.artifact import save_model
from optpipe.pass_infra.pass_base import Pass, PassParams
from optpipe.passes import register_pass, unregister_pass
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe


class NoiseParams(PassParams):
    scale: float = 0.5


class NoisePass(Pass):
    """Adds noise to every weight: a stage that breaks the tolerance."""

    name = "test-noise"
    Params = NoiseParams

    def run(self, model, ctx):
        proto = model.load()
        rng = np.random.default_rng(0)
        for init in proto.graph.initializer:
            array = numpy_helper.to_array(init)
            if array.dtype == np.float32 and array.size > 1:
                init.CopyFrom(numpy_helper.from_array(array + rng.normal(0, self.params.scale, array.shape).astype(np.float32), init.name))
        return save_model(proto, ctx.workdir)


@pytest.fixture(autouse=True)
def noise_pass():
    register_pass(NoisePass)
    yield
    unregister_pass(NoisePass.name)


def test_export_needs_the_flag_for_out_of_tolerance_and_force_measures_again(tiny_recipe, cli_run, cache_dir, tmp_path):
    path = tiny_recipe({"stages": {"noisy": {"pass": "test-noise", "after": "simplify"},
                                   "again": {"pass": "simplify", "after": "simplify"}}})
    cli_run("compile", str(path))
    run = tmp_path / "run"
    # A pass with nothing left to do says so instead of a bare "ok".
    report = (run / "report.md").read_text()
    assert "`again`: this stage changed nothing" in report
    assert "noisy" not in report.split("## Warnings")[1].split("##")[0], "a stage that changed the weights did something"
    # --force: the eager baseline has no pass, so only its evaluation could be cached; it is measured again.
    forced = compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir, force=True))
    assert not any(s.cached for s in forced.stages)
    refused = cli_run("export", str(run), "--stage", "noisy", "--format", "ort", "--to", str(tmp_path / "out"))
    assert refused.exit_code == 2
    assert "out of tolerance" in refused.output and "--allow-out-of-tolerance" in refused.output
    assert not (tmp_path / "out").exists()
    allowed = cli_run("export", str(run), "--stage", "noisy", "--format", "ort", "--to", str(tmp_path / "out"),
                      "--allow-out-of-tolerance")
    assert allowed.exit_code == 0, allowed.output
    assert "warning: 'noisy' is out of tolerance" in allowed.output
    fine = cli_run("export", str(run), "--stage", "simplify", "--format", "ort", "--to", str(tmp_path / "out2"))
    assert fine.exit_code == 0 and "out of tolerance" not in fine.output
