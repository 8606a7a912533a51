"""The one numeric self-check: the same rule and metric for every self-checked pass, run by the
stage runner after the pass (an instrument), recorded in info.json, failing the stage when enforced."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from optpipe.core.errors import PassError
from optpipe.evaluation.accuracy import compare
from optpipe.evaluation.self_check import SelfCheckParams, numeric_check
from optpipe.passes import registry
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.recipe.schema import Tolerance
from optpipe.safety.recipe_loading import load_recipe

TESTS = Path(__file__).resolve().parent
RNG = np.random.default_rng(0)


def test_pixel_scale_outputs_pass_on_rounding_and_fail_on_a_real_error():
    """Boxes in the hundreds of pixels: float32 rounding exceeds 1e-3 absolute, never 1e-3 relative."""
    reference = {"boxes": RNG.uniform(0, 640, size=(2, 100, 4)).astype(np.float32)}
    rounding = {"boxes": reference["boxes"] * np.float32(1 + 4e-6)}
    assert np.abs(rounding["boxes"] - reference["boxes"]).max() > 1e-3
    feeds = {"image": np.zeros((2, 3, 8, 8), np.float32)}
    record = numeric_check(rounding, reference, feeds, SelfCheckParams(), "input")
    assert record["passed"] and record["enforced"] and record["max_abs"] > 1e-3

    shifted = {"boxes": reference["boxes"] + np.float32(2.0)}  # two pixels off: a broken model
    with pytest.raises(PassError, match="self-check against input failed: output 'boxes'"):
        numeric_check(shifted, reference, feeds, SelfCheckParams(), "input")
    atol_only = SelfCheckParams(check_atol=1e-3, check_rtol=None)
    with pytest.raises(PassError, match="max abs error"):
        numeric_check(rounding, reference, feeds, atol_only, "input")


def test_a_float16_output_is_held_to_float16_rounding_where_the_tolerances_are_left_at_their_defaults():
    """An exact rewrite of a float16 graph moves its outputs by a few float16 ULPs, beyond the float32 defaults
    (1e-3 + 1e-3 x |out|): the MiniLM export converted to FP16, as an ONNX source, failed simplify's and fuse's
    self-checks at cosine 0.9999997. Float16 outputs left at the defaults are held to 1e-2; a float32 output beside
    them keeps 1e-3, a tolerance the recipe set is kept, and a real error still fails."""
    hidden = RNG.uniform(-6, 6, size=(2, 8, 32)).astype(np.float16)
    ulp = np.spacing(np.abs(hidden))
    rounding = (hidden + np.float16(4) * ulp * RNG.choice([-1, 1], size=hidden.shape)).astype(np.float16)  # 4 ULPs
    assert not np.all(np.abs(rounding.astype(np.float32) - hidden) <= 1e-3 + 1e-3 * np.abs(hidden.astype(np.float32)))
    feeds = {"input_ids": np.zeros((2, 8), np.int64)}
    record = numeric_check({"h": rounding}, {"h": hidden}, feeds, SelfCheckParams(), "input")
    assert record["passed"] and record["float16_outputs"] == {"h": {"max_abs": 1e-2, "rtol": 1e-2}}

    broken = {"h": (hidden + np.float16(0.25)).astype(np.float16)}
    with pytest.raises(PassError, match="output 'h'.*float16 outputs 0.01 where left at the defaults"):
        numeric_check(broken, {"h": hidden}, feeds, SelfCheckParams(), "input")
    with pytest.raises(PassError, match="output 'h'"):  # the recipe's own tolerance stands
        numeric_check({"h": rounding}, {"h": hidden}, feeds, SelfCheckParams(check_atol=1e-3, check_rtol=1e-3), "input")
    wide = hidden.astype(np.float32)  # a float32 output with the same error keeps float32's defaults
    with pytest.raises(PassError, match="output 'wide'"):
        numeric_check({"h": rounding, "wide": rounding.astype(np.float32)}, {"h": hidden, "wide": wide}, feeds,
                      SelfCheckParams(), "input")


def test_cosine_is_the_reports_cosine_per_token_over_real_tokens():
    """A transformer output with padding: the self-check's cosine is compare()'s, masked, per token."""
    hidden = RNG.normal(size=(2, 6, 16)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.int64)
    candidate = hidden.copy()
    candidate[0, 4:] = RNG.normal(size=(2, 16))  # garbage only on padded positions
    candidate[1, 0] *= -1  # one real token flipped
    feeds = {"input_ids": np.zeros((2, 6), np.int64), "attention_mask": mask}
    record = numeric_check({"h": candidate}, {"h": hidden}, feeds, SelfCheckParams(check_atol=None, check_rtol=None), "input")
    report = compare({"h": candidate}, {"h": hidden}, feeds, Tolerance(), "input", top1=False)
    assert record["cosine"] == pytest.approx(report.worst_cosine)
    assert record["cosine"] == pytest.approx((9 - 1) / 10), "10 real tokens, one at cosine -1, padding ignored"
    assert not record["enforced"] and record["passed"] is None, "recorded, never judged with both tolerances None"


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("OPTPIPE_PLUGINS", "contract_passes")
    registry.cache_clear()
    yield
    monkeypatch.delenv("OPTPIPE_PLUGINS")
    registry.cache_clear()
    sys.modules.pop("contract_passes", None)


def test_self_check_runs_after_a_pass_and_fails_or_records(plugin, tiny_recipe, cache_dir, tmp_path):
    stages = {
        "simplify": None,
        "broken": {"pass": "contract-noisy", "after": "export", "params": {"scale": 0.5}},
        "recorded": {"pass": "contract-noisy", "after": "export", "params": {"scale": 0.5, "check_atol": None, "check_rtol": None}},
    }
    recipe = load_recipe(tiny_recipe({"stages": stages, "evaluate": {"eager_baseline": False}}))
    report = compile_recipe(recipe, RunOptions(cache_dir=cache_dir))
    assert report.stage("broken").status == "failed"
    assert "self-check against input failed" in report.stage("broken").reason
    assert not (tmp_path / "run" / "stages" / "broken").exists(), "a stage failing its self-check is never published"
    recorded = report.stage("recorded")
    assert recorded.status == "ok" and recorded.info["self_check"]["against"] == "input"
    assert recorded.info["self_check"]["passed"] is None and recorded.info["self_check"]["cosine"] < 0.99
    export = report.stage("export").info["self_check"]
    assert export["against"] == "pytorch-eager" and export["passed"] and export["check_rtol"] == 1e-3


def test_the_pass_s_freed_copies_are_handed_back_before_the_check_runs_its_two_sessions(plugin, tiny_recipe, cache_dir, monkeypatch):
    """Gemma 3 270M's simplify: its self-check peaked at 6.82 GB on the copies onnxslim had freed, 4.75 GB
    once they were handed back first (docs/llm.md). The check asks for that before its first session."""
    from optpipe.evaluation import self_check

    order = []
    monkeypatch.setattr(self_check, "release_freed_memory", lambda: order.append("release"))
    real = self_check.input_outputs
    monkeypatch.setattr(self_check, "input_outputs", lambda *a, **k: (order.append("input session"), real(*a, **k))[1])
    recipe = load_recipe(tiny_recipe({"evaluate": {"eager_baseline": False}}))
    report = compile_recipe(recipe, RunOptions(cache_dir=cache_dir))
    assert report.stage("simplify").status == "ok" and "input session" in order
    assert all(order[i - 1] == "release" for i, step in enumerate(order) if step == "input session")


def test_eager_handed_over_is_taken_once_and_only_for_the_same_feeds(tmp_path):
    from optpipe.evaluation.self_check import _handed_outputs, hand_over_eager, take_eager

    workdir = tmp_path / "work-1"
    workdir.mkdir()
    feeds = {"x": RNG.normal(size=(2, 4)).astype(np.float32)}
    outputs = {"y": RNG.normal(size=(2, 3)).astype(np.float32)}
    hand_over_eager(workdir, feeds, outputs, {"tokens": np.arange(4)})
    assert list(workdir.iterdir()) == []  # beside the workdir, which holds the artifact's files only
    handed = take_eager(workdir)
    assert np.array_equal(handed["outputs"]["y"], outputs["y"]) and np.array_equal(handed["generation"]["tokens"], np.arange(4))
    assert _handed_outputs(handed, feeds) is handed["outputs"]
    assert _handed_outputs(handed, {"x": feeds["x"] + 1}) is None and _handed_outputs(handed, {**feeds, "z": feeds["x"]}) is None
    assert take_eager(workdir) is None  # taken: a later stage in a reused folder never sees it


def test_a_torn_hand_over_is_no_reference(tmp_path):
    from optpipe.evaluation.self_check import HANDOVER_SUFFIX, take_eager

    (tmp_path / ("work-2" + HANDOVER_SUFFIX)).write_bytes(b"PK\x03\x04 not a whole npz")
    assert take_eager(tmp_path / "work-2") is None
    assert not (tmp_path / ("work-2" + HANDOVER_SUFFIX)).exists()


def test_a_released_workdir_takes_what_was_left_beside_it(tmp_path):
    from optpipe.cache.store import StageCache
    from optpipe.evaluation.self_check import HANDOVER_SUFFIX

    cache = StageCache(tmp_path / "cache")
    workdir = cache.new_workdir()
    beside = workdir.with_name(workdir.name + HANDOVER_SUFFIX)
    beside.write_bytes(b"left by a stage that failed before its self-check")
    other = workdir.with_name(workdir.name + "x" + HANDOVER_SUFFIX)  # another workdir's: kept
    other.write_bytes(b"")
    cache.release_workdir(workdir)
    assert not workdir.exists() and not beside.exists() and other.exists()
