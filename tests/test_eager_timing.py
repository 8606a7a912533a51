"""evaluate.eager_timing: PyTorch eager timed interleaved with each stage, or apart (its model released before
each stage's runtime is built, loaded again and timed right after it), and auto's choice by the model's size."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import yaml

from test_generation_report import decoder_recipe


def test_auto_times_eager_apart_only_where_the_two_would_not_fit_in_memory():
    from optpipe.plan.source_preflight import eager_timing
    from optpipe.safety import memory_estimate

    weights = 4 << 30
    need = memory_estimate.stage_estimates(weights, {"e": memory_estimate.EAGER_EVALUATION})["e"]
    fits = int(need / memory_estimate.HEADROOM) + (1 << 20)
    assert eager_timing("auto", weights, available=fits) == "interleaved"
    assert eager_timing("auto", weights, available=fits - (64 << 20)) == "apart"
    assert eager_timing("auto", None, available=1) == "interleaved"  # a factory: its size is unknown before it loads
    assert eager_timing("interleaved", weights, available=1) == "interleaved"  # the recipe's word wins
    assert eager_timing("apart", 1, available=1 << 40) == "apart"


def test_the_memory_preflight_holds_no_eager_beside_a_stage_when_apart(tmp_path, monkeypatch):
    from optpipe.plan.source_preflight import estimated_steps
    from optpipe.safety import memory_estimate
    from optpipe.safety.recipe_loading import parse_recipe

    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path).read_text()))
    assert estimated_steps(recipe, 1 << 20)["pytorch-eager"] == memory_estimate.EAGER_EVALUATION
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: 3 << 30)  # a small machine: 4 GB of weights twice won't fit
    assert estimated_steps(recipe, 4 << 30)["pytorch-eager"] == memory_estimate.EAGER_APART
    gb = 4 << 30
    apart = memory_estimate.stage_estimates(gb, {"e": memory_estimate.EAGER_APART})["e"]
    assert apart < memory_estimate.stage_estimates(gb, {"e": memory_estimate.EAGER_EVALUATION})["e"]


@pytest.fixture
def watched_models(monkeypatch):
    """Every torch model the run loads, weakly: which are alive when a stage's runtime is built for its evaluation."""
    from optpipe.execution import services

    loaded: list[weakref.ref] = []
    real = services.load_torch_model

    def load(source):
        model = real(source)
        loaded.append(weakref.ref(model))
        return model

    monkeypatch.setattr(services, "load_torch_model", load)

    def alive() -> int:
        gc.collect()
        return sum(ref() is not None for ref in loaded)

    return loaded, alive


def _watch_runtimes(monkeypatch, module, name: str, alive, seen: list[int]):
    real = getattr(module, name)

    def build(*args, **kwargs):
        seen.append(alive())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, build)


def test_apart_an_encoder_stage_s_runtime_is_built_with_no_torch_model_and_eager_is_timed_after_it(
        tiny_recipe, cli_run, tmp_path, monkeypatch, watched_models):
    from optpipe.evaluation import evaluator

    loaded, alive = watched_models
    seen: list[int] = []
    _watch_runtimes(monkeypatch, evaluator, "ort_session", alive, seen)
    result = cli_run("compile", str(tiny_recipe({"evaluate": {"eager_timing": "apart"}})))
    assert result.exit_code == 0, result.output
    assert seen and all(count == 0 for count in seen), seen  # no torch model beside any stage's session
    assert len(loaded) >= 1 + 2  # eager's own evaluation, then once after each of the two stages
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    for stage in (s for s in report["stages"] if s["name"] != "pytorch-eager"):
        headline = stage["latency"][0]
        assert headline["eager_apart"] and headline["eager_p50_ms"] > 0, stage["name"]
    assert "timed right after that stage, alone" in (tmp_path / "run" / "report.md").read_text()


def test_interleaved_is_the_default_where_it_fits_and_keeps_eager_beside_the_stage(tiny_recipe, cli_run, tmp_path,
                                                                                      monkeypatch, watched_models):
    from optpipe.evaluation import evaluator

    _, alive = watched_models
    seen: list[int] = []
    _watch_runtimes(monkeypatch, evaluator, "ort_session", alive, seen)
    assert cli_run("compile", str(tiny_recipe())).exit_code == 0
    assert seen and all(count == 1 for count in seen), seen  # eager held beside every stage: timed interleaved
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    stages = [s for s in report["stages"] if s["name"] != "pytorch-eager"]
    assert all(not s["latency"][0]["eager_apart"] and s["latency"][0]["eager_p50_ms"] > 0 for s in stages)
    assert "timed interleaved with that stage" in (tmp_path / "run" / "report.md").read_text()


def test_apart_a_decoder_stage_generates_with_no_torch_model_and_its_rows_carry_eager_s_figures(
        tmp_path, cli_run, monkeypatch, watched_models):
    from optpipe.evaluation import generation

    loaded, alive = watched_models
    seen: list[int] = []
    _watch_runtimes(monkeypatch, generation.OrtRunner, "__init__", alive, seen)
    stages = {"export": {"pass": "export"}, "int8w": {"pass": "weight_only", "after": "export", "params": {"bits": 8}}}
    recipe = decoder_recipe(tmp_path, stages=stages)
    data = yaml.safe_load(recipe.read_text())
    data["evaluate"]["eager_timing"] = "apart"
    recipe.write_text(yaml.safe_dump(data))
    result = cli_run("compile", str(recipe))
    assert result.exit_code == 0, result.output
    # The export's self-check builds its session in the pass (the model may be alive there); the evaluations' two
    # ORT runtimes, built after, see none.
    assert seen[-2:] == [0, 0], seen
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    for stage in (s for s in report["stages"] if s["name"] != "pytorch-eager"):
        assert all(row["eager_decode_tokens_per_s"] > 0 and row["eager_ttft_ms"] > 0 for row in stage["generation"]["rows"])
        assert all(lat["eager_apart"] and lat["eager_p50_ms"] > 0 for lat in stage["latency"]), stage["name"]
        assert stage["generation"]["next_token_agreement"] is not None  # the reference's tokens were kept, not the model
    assert len(loaded) >= 3
    # Apart is in the evaluation's key: asking for interleaved measures again rather than reusing these rows.
    data["evaluate"]["eager_timing"] = "interleaved"
    recipe.write_text(yaml.safe_dump(data))
    assert cli_run("compile", str(recipe)).exit_code == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    export = next(s for s in report["stages"] if s["name"] == "export")
    assert not export["evaluation_cached"] and not export["latency"][0]["eager_apart"]
