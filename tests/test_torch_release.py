"""A big torch model is dropped once no stage left reads it (execution/services.py), and the eager
evaluation loads it again: the same figures as a run that held it throughout."""
from __future__ import annotations

from optpipe.execution import services
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.pass_infra.instruments import Instrument
from optpipe.safety.recipe_loading import load_recipe
from test_generation_report import decoder_recipe


class Loaded(Instrument):
    """Whether the run held a torch model while each stage's pass ran."""

    def __init__(self, held: dict):
        self.held = held

    def before_stage(self, info):
        self.held[info.name] = services.RunServices.torch_model.cache_info().currsize > 0


def _compile(tmp_path, monkeypatch, release_bytes: int):
    tmp_path.mkdir()
    loads, held = [], {}
    real = services.load_torch_model
    monkeypatch.setattr(services, "load_torch_model", lambda source: loads.append(1) or real(source))
    monkeypatch.setattr(services, "RELEASE_BYTES", release_bytes)
    stages = {"export": {"pass": "export"},
              "int4": {"pass": "weight_only", "after": "export", "params": {"bits": 4, "block_size": 32}},
              "int8": {"pass": "weight_only", "after": "export", "params": {"bits": 8, "block_size": 32}}}
    recipe = load_recipe(decoder_recipe(tmp_path, stages=stages, cache=str(tmp_path / "cache")))
    report = compile_recipe(recipe, RunOptions(instruments=[Loaded(held)], force=True))
    return report, len(loads), held


def test_a_big_torch_model_is_dropped_after_the_export_and_reloaded_for_eager(tmp_path, monkeypatch):
    kept, kept_loads, kept_held = _compile(tmp_path / "kept", monkeypatch, 1 << 60)  # tiny: never released
    dropped, dropped_loads, dropped_held = _compile(tmp_path / "dropped", monkeypatch, 0)  # every model counts as big
    # (before the export the class-level lru_cache may still hold an earlier run's model: not asserted)
    assert kept_loads == 1 and (kept_held["int4"], kept_held["int8"]) == (True, True)
    assert dropped_loads == 2 and (dropped_held["int4"], dropped_held["int8"]) == (False, False)
    for a, b in zip(kept.stages, dropped.stages):
        assert (a.name, a.status) == (b.name, b.status)
        # The reloaded model is the same seeded one: eager's greedy tokens, hence every agreement and perplexity, equal.
        assert a.generation.perplexity == b.generation.perplexity, a.name
        assert a.generation.next_token_agreement == b.generation.next_token_agreement, a.name
