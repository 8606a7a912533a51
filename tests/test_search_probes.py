"""Search inputs the bundled recipes never use: a space too big to list, choices that are no plain
value, ranges that are wrong in their own way, a stage that cannot be off, a refusal that is the
stage's and not a searched value's, and the best trial against the search's own objectives."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from optpipe.core.errors import RecipeError
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.search.driver import describe_search
from optpipe.search.report import _best, trial_frontier
from optpipe.search.space import SearchSpace
from optpipe.search.strategies import GridProposer

REPO = Path(__file__).resolve().parents[1]


def _data(stages: dict, search: dict | None = None) -> dict:
    data = yaml.safe_load((REPO / "recipes" / "tiny-search.yaml").read_text())
    data["model"]["path"] = str(REPO / "recipes" / "models")
    data["stages"] = {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}, **stages}
    data["evaluate"]["search"] = search or {"strategy": "grid"}
    return data


def _listed_grid(space: SearchSpace) -> list:
    """The grid as the plain product of every dimension, a stage that is off collapsed to one point."""
    keys = [d.key for d in space.dimensions]
    return list(dict.fromkeys(space.trial(dict(zip(keys, c))) for c in itertools.product(*(d.values for d in space.dimensions))))


def test_grid_order_and_points_match_the_listed_product():
    space = SearchSpace(parse_recipe(_data({
        "prune": {"pass": "prune", "after": "simplify", "optional": True, "params": {"method": "magnitude"},
                  "search": {"amount": [0.1, 0.2, 0.3], "round_to": [1, 8]}},
        "int8": {"pass": "int8", "after": "prune", "optional": True, "params": {"mode": "dynamic"},
                 "search": {"per_channel": [True, False], "reduce_range": [False, True]}},
        "fp16": {"pass": "fp16", "after": "int8", "optional": True}})))
    listed = _listed_grid(space)
    assert space.size == len(listed) == (3 * 2 + 1) * (2 * 2 + 1) * 2
    assert list(space.grid()) == listed
    assert [space.point(i) for i in range(space.size)] == listed
    with pytest.raises(IndexError):
        space.point(space.size)


def test_a_space_of_a_hundred_million_points_is_counted_not_listed():
    # 9,999 x 5,000 x 2 points: listing them took 5 GB and over a minute before `validate` answered.
    data = _data({"prune": {"pass": "prune", "after": "simplify", "params": {"method": "magnitude"},
                            "search": {"amount": {"min": 0.0001, "max": 0.9999, "step": 0.0001},
                                       "min_channels": {"min": 1, "max": 5000, "step": 1}}},
                  "int8": {"pass": "int8", "after": "prune", "params": {"mode": "dynamic"}, "search": {"per_channel": [True, False]}}},
                 {"strategy": "optuna", "trials": 3})
    recipe = parse_recipe(data)
    space = SearchSpace(recipe)
    assert space.size == 9999 * 5000 * 2
    assert "optuna over 99990000 points" in describe_search(recipe) and "up to 3 trials" in describe_search(recipe)
    last = space.point(space.size - 1)
    assert last.get("prune.amount") == 0.9999 and last.get("prune.min_channels") == 5000 and last.get("int8.per_channel") is False
    # A budget on such a grid samples indices, the same on every rerun, each a point of the space.
    first, again = GridProposer(space, budget=5, seed=3), GridProposer(space, budget=5, seed=3)
    trials = [t for _, t in first.ask(10)]
    assert len(set(trials)) == 5 and first.exhausted() and trials == [t for _, t in again.ask(10)]


@pytest.mark.parametrize("choices, message", [
    ([[[0.2]], 0.5], r"stages\.prune\.search\.amount: choice \[\[0\.2\]\] is not a plain value or a list of them"),
    ([{"a": 1}], r"stages\.prune\.search\.amount: choice \{'a': 1\} is not a plain value"),
    ({"min": 0.5, "max": 0.1, "step": 0.1}, r"stages\.prune\.search\.amount: expected min <= max"),
    ({"min": 0.1, "max": 0.5, "step": 0}, r"stages\.prune\.search\.amount\.step: Input should be greater than 0"),
    ({"min": 0.1, "max": float("inf"), "step": 0.1}, r"stages\.prune\.search\.amount\.max: Input should be a finite number"),
    ({"min": 0.1, "max": 0.5}, r"stages\.prune\.search\.amount\.step: required key is missing"),
    ({"min": 0.1, "max": 0.5, "step": 0.1, "stop": 1}, r"stages\.prune\.search\.amount\.stop: unknown key"),
    (0.2, r"stages\.prune\.search\.amount: Input should be a valid list"),
])
def test_bad_choices_name_their_own_problem_in_one_line(choices, message):
    data = _data({"prune": {"pass": "prune", "after": "simplify", "params": {"method": "magnitude"}, "search": {"amount": choices}}})
    with pytest.raises(RecipeError, match=message) as caught:
        SearchSpace(parse_recipe(data))
    assert "\n" not in str(caught.value) and "<" not in str(caught.value).split(":")[0]


def test_the_first_stage_of_the_chain_cannot_be_off_when_stages_start_from_it():
    data = _data({})
    data["stages"]["export"]["optional"] = True
    with pytest.raises(RecipeError, match=r"^stages\.export\.optional: 'export' makes the model that 'simplify'"):
        SearchSpace(parse_recipe(data))


def test_a_refusal_no_searched_value_escapes_names_the_stage_not_a_value():
    # int8 without `after:` fails whatever per_channel is: the user's line is the stage's.
    data = _data({"int8": {"pass": "int8", "optional": True, "params": {"mode": "dynamic"}, "search": {"per_channel": [True, False]}}})
    with pytest.raises(RecipeError, match=r"^stages\.int8: pass 'int8' transforms a model"):
        describe_search(parse_recipe(data))
    data = _data({"prune": {"pass": "prunee", "after": "simplify", "search": {"amount": [0.2, 0.5]}}})
    with pytest.raises(RecipeError, match=r"^stages\.prune\.pass: unknown pass 'prunee' \(did you mean 'prune'\?\)"):
        describe_search(parse_recipe(data))  # the key kept: it was `stages.prune: unknown pass`
    # ... while a value refused where another passes is still named, even as the first choice.
    data = _data({"int8": {"pass": "int8", "after": "simplify", "search": {"mode": ["static", "dynamic"]}}})
    with pytest.raises(RecipeError, match=r"^stages\.int8\.search\.mode \(choice 'static'\): static int8 calibrates"):
        describe_search(parse_recipe(data))


def _row(number: int, stage: str, p50: float, cosine: float, size: int) -> dict:
    return {"number": number, "stage": stage, "repeat_of": None, "status": "ok", "params": {}, "p50_ms": p50,
            "cosine": cosine, "size_bytes": size}


@pytest.mark.parametrize("objectives, best", [
    (["latency", "accuracy", "size"], "half"),  # 'pruned' is 1% faster (noise) but half's size and accuracy beat it
    (["accuracy", "size"], "half"),  # no latency asked: the p50s play no part
    (["size", "accuracy"], "half"),
    (["accuracy"], "float"),
    (["latency", "accuracy"], "float"),  # the three p50s are equal within noise: the most accurate
])
def test_the_best_trial_is_a_candidate_ranked_on_the_searchs_objectives(objectives, best):
    rows = [_row(1, "pruned", 0.0693, 0.97, 4000), _row(2, "half", 0.0700, 0.999, 2000), _row(3, "float", 0.0701, 1.0, 4000)]
    candidates = trial_frontier(rows, objectives, within_tolerance_only=True)
    picked = _best(rows, candidates, objectives)
    assert picked["stage"] == best and best in candidates


def test_values_written_alike_stay_two_stages_with_their_own_params():
    space = SearchSpace(parse_recipe(_data({"int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"},
                                                      "search": {"op_types": ["a b", "a-b"]}}})))
    expanded, leaves = space.expand(list(space.grid()))
    assert [expanded.stages[leaves[t]].params["op_types"] for t in space.grid()] == ["a b", "a-b"]

    # smooth_quant_alpha: a negative disables SmoothQuant; -0.5 and 0.5 were both `..._alpha-0.5`:
    # one stage, whose figures were reported for both trials.
    data = _data({"prune": {"pass": "prune", "after": "simplify", "optional": True, "params": {"method": "magnitude"},
                            "search": {"amount": [0.2, 0.4]}},
                  "ov": {"pass": "openvino", "after": "prune", "params": {"precision": "int8"},
                         "search": {"smooth_quant_alpha": [-0.5, 0.5]}}})
    space = SearchSpace(parse_recipe(data))
    expanded, leaves = space.expand(list(space.grid()))
    assert len(set(leaves.values())) == space.size == 3 * 2
    assert "ov__prune-off__smooth_quant_alpha--0.5" in expanded.stages  # the sign is in the name
    for trial, leaf in leaves.items():
        assert expanded.stages[leaf].params["smooth_quant_alpha"] == trial.get("ov.smooth_quant_alpha")
        parent = expanded.stages[leaf].after
        if trial.get("prune.enabled"):
            assert expanded.stages[parent].params["amount"] == trial.get("prune.amount")
        else:
            assert parent == "simplify"


def test_the_trial_budget_counts_distinct_points_and_a_sampler_stuck_on_tried_ones_stops(tmp_path, monkeypatch):
    import io

    import optpipe.search.driver as driver_module
    from optpipe.execution.executors import LocalExecutor, Progress
    from optpipe.search.runner import compile_recipes

    class _Stuck:
        """A sampler that proposes one point forever (Optuna's may, on a small categorical space)."""

        def __init__(self, space, *args):
            self.point = next(space.grid())

        def ask(self, count):
            return [(None, self.point)] * count

        def tell(self, handle, result, refused=None):
            pass

        def exhausted(self):
            return False

        def resumed(self):
            return []

        def close(self):
            pass

    monkeypatch.setattr(driver_module, "make_proposer", lambda space, *args: _Stuck(space))
    data = _data({"int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"}, "search": {"per_channel": [True, False]}}},
                 {"strategy": "optuna", "trials": 2})
    data["output"] = str(tmp_path / "run")
    data["evaluate"].update(batch_sizes=[1], warmup=1, iterations=3)
    stream = io.StringIO()
    [(report, failed)] = compile_recipes([parse_recipe(data)], LocalExecutor(), cache_dir=tmp_path / "cache", progress=Progress(stream))
    trials = report.search["trials"]
    assert report.search["stopped"] == f"the sampler proposed only points already tried, {driver_module.REPEAT_LIMIT} in a row"
    assert len(trials) == 1 + driver_module.REPEAT_LIMIT and [t["repeat_of"] for t in trials[1:]] == [1] * driver_module.REPEAT_LIMIT
    assert "trial 2 (point 1/2) ok (repeat of trial 1)" in stream.getvalue() and failed == []


def test_searching_enabled_is_refused_for_optional():
    # `enabled` is the pseudo-param of `optional: true`; searched by hand it made two trials of one model.
    data = _data({"int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"}, "search": {"enabled": [True, False]}}})
    with pytest.raises(RecipeError, match=r"^stages\.int8\.search\.enabled: no pass has this param; write `optional: true`"):
        SearchSpace(parse_recipe(data))


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_optuna_cannot_take_is_a_recipe_error(seed):
    # numpy refused it mid-run: 'internal error: ValueError: Seed must be between 0 and 2**32 - 1'.
    with pytest.raises(RecipeError, match=r"evaluate\.search\.seed: Input should be (greater|less) than or equal to"):
        parse_recipe(_data({}, {"strategy": "optuna", "trials": 2, "seed": seed}))


def test_a_grid_budget_samples_a_space_past_2_to_the_63():
    ranges = {p: {"min": 1, "max": 10_000, "step": 1} for p in ("max_excluded", "rank_samples", "guard_trials", "calibration_batch")}
    data = _data({"int8": {"pass": "int8", "after": "simplify", "search": {**ranges, "percentile": {"min": 90, "max": 99.999, "step": 0.001}}}},
                 {"strategy": "grid", "trials": 4})
    space = SearchSpace(parse_recipe(data))
    assert space.size == 10_000 ** 4 * 9_999 + 10_000 ** 4  # 99.999 falls on a step: 10,000 percentiles
    trials = [t for _, t in GridProposer(space, budget=4, seed=0).ask(4)]
    assert len(set(trials)) == 4 and all(1 <= t.get("int8.max_excluded") <= 10_000 for t in trials)


@pytest.mark.parametrize("which", ["its own", "a wider space's source"])
def test_a_study_log_that_cannot_be_read_is_one_line_naming_it(tmp_path, which):
    import optuna
    from filelock import FileLock

    from optpipe.core.errors import OptpipeError
    from optpipe.search.study import open_study

    space = SearchSpace(parse_recipe(_data({"int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"},
                                                      "search": {"per_channel": [True, False]}}})))
    own, other = tmp_path / "abc-new.journal", tmp_path / "abc-old.journal"
    broken = own if which == "its own" else other
    broken.write_text("not json{\n")  # edited by hand, or cut by a broken disk: was an internal error
    sampler = optuna.samplers.TPESampler(seed=0)
    with pytest.raises(OptpipeError, match=rf"^{broken}: the saved Optuna study cannot be read \(\w+: .*\); delete it"):
        open_study(optuna, own, "abc", space, ["minimize", "maximize"], sampler, fresh=False)
    assert FileLock(str(own) + ".driver.lock").acquire(timeout=0)  # released: a rerun is not told another drives it


def test_a_target_without_stages_emits_the_search_s_candidates():
    from types import SimpleNamespace

    from optpipe.targets import default_target_stages

    # The run's own frontier weighs p50 too: in a search over accuracy and size it held a trial
    # 8% faster by noise (and the unsearched export), which the targets then built.
    search = {"frontier": ["int8__off", "simplify", "prune__0.5"], "frontier_within_tolerance": ["int8__off", "simplify"]}
    report = SimpleNamespace(search=search, pareto=["export", "simplify", "prune__0.2", "int8__off"])
    assert default_target_stages(report) == ["int8__off", "simplify"]
    assert default_target_stages(SimpleNamespace(search=None, pareto=["export"])) == ["export"]
    assert default_target_stages(SimpleNamespace(search={**search, "frontier_within_tolerance": []}, pareto=["export"])) == []


def test_a_list_param_is_searched_over_lists_by_a_resumed_optuna_study(tmp_path):
    # The "FP16: blocked ops": op_block_list takes a list; each choice is one list.
    import io
    import json

    from optpipe.execution.executors import LocalExecutor, Progress
    from optpipe.search.runner import compile_recipes

    blocked = [[], ["MatMul"], ["Gemm", "MatMul"]]
    data = _data({"fp16": {"pass": "fp16", "after": "simplify", "params": {"guard": False},
                           "search": {"op_block_list": blocked}}}, {"strategy": "optuna", "trials": 3, "seed": 1})
    data["output"] = str(tmp_path / "run")
    data["evaluate"].update(batch_sizes=[1], warmup=1, iterations=3)
    recipe = parse_recipe(data)
    assert "op_block_list: 3" in describe_search(recipe)
    expanded, leaves = SearchSpace(recipe).expand(list(SearchSpace(recipe).grid()))
    assert sorted(leaves.values()) == ["fp16__op_block_list-Gemm-MatMul", "fp16__op_block_list-MatMul", "fp16__op_block_list-none"]

    def run():
        stream = io.StringIO()
        [(report, failed)] = compile_recipes([recipe], LocalExecutor(), cache_dir=tmp_path / "cache", progress=Progress(stream))
        return report, failed, stream.getvalue()

    report, failed, _ = run()
    trials = report.search["trials"]
    assert failed == [] and sorted(t["params"]["fp16.op_block_list"] for t in trials if t["repeat_of"] is None) == sorted(blocked)
    stored = json.loads((tmp_path / "run" / "report.json").read_text())["stages"]
    for trial in trials:  # each trial's stage ran the pass with its own list
        stage = next(s for s in stored if s["name"] == trial["stage"])
        assert stage["status"] == "ok" and stage["info"]["op_block_list"] == sorted(trial["params"]["fp16.op_block_list"])
    again, _, progress = run()  # the saved study's list choices come back as lists
    assert [t["params"] for t in again.search["trials"]] == [t["params"] for t in trials] and "from the saved study" in progress


def test_a_combination_refused_past_validation_is_a_failed_trial_and_the_search_goes_on(tmp_path, monkeypatch):
    import io

    from optpipe.execution.executors import LocalExecutor, Progress
    from optpipe.search import checks
    from optpipe.search.runner import compile_recipes

    # Past MAX_COMBINATIONS only each value beside the others' first is checked before the run:
    # (0.3, 2:4) is first seen when the grid proposes it. It stopped the compile (exit 2, no report).
    monkeypatch.setattr(checks, "MAX_COMBINATIONS", 3)
    data = _data({"prune": {"pass": "prune", "after": "simplify", "search": {"amount": [0.5, 0.3], "method": ["magnitude", "2:4"]}}})
    data["output"] = str(tmp_path / "run")
    data["evaluate"].update(batch_sizes=[1], warmup=1, iterations=3)
    recipe = parse_recipe(data)
    describe_search(recipe)  # valid as far as validation looks
    stream = io.StringIO()
    [(report, failed)] = compile_recipes([recipe], LocalExecutor(), cache_dir=tmp_path / "cache", progress=Progress(stream))
    trials = {(t["params"]["prune.amount"], t["params"]["prune.method"]): t for t in report.search["trials"]}
    assert len(trials) == 4 and failed == []
    refused = trials[(0.3, "2:4")]
    assert refused["status"] == "failed" and refused["stage"] is None
    assert refused["reason"].startswith("stages.prune.search.") and "refused beside" in refused["reason"]
    assert trials[(0.5, "2:4")]["status"] in ("ok", "out of tolerance") and trials[(0.3, "magnitude")]["status"] == "ok"
    assert "failed: prune.amount=0.3, prune.method=2:4 -> None — stages.prune.search." in stream.getvalue()
    assert "| 0.3 | 2:4 | — (not run) | failed |" in (tmp_path / "run" / "report.md").read_text()


def test_validate_of_a_big_unbudgeted_grid_says_compile_will_ask_for_yes():
    data = _data({"prune": {"pass": "prune", "after": "simplify", "params": {"method": "magnitude"},
                            "search": {"amount": {"min": 0.01, "max": 0.9, "step": 0.01}}}})
    assert describe_search(parse_recipe(data)).endswith("90 trials (more than 64: `optpipe compile` asks for --yes)")
    data["evaluate"]["search"]["trials"] = 70
    assert "asks for --yes" not in describe_search(parse_recipe(data))


def test_the_search_ranks_accuracy_by_the_task_metric_the_verdict_uses():
    from optpipe.core.results import Accuracy, Latency, OutputAccuracy, StageResult, TaskAccuracy
    from optpipe.search.strategies import objective_values

    # With a task, cosine and top-1 disagree: 'smooth' keeps cosine 0.999 but flips 10% of the
    # top-1 labels; 'sharp' has cosine 0.98 and flips 2%. The verdict and the run's frontier use top-1.
    rows = [{**_row(1, "smooth", 1.0, 0.999, 1000), "error": 0.10}, {**_row(2, "sharp", 1.0, 0.98, 1000), "error": 0.02}]
    assert trial_frontier(rows, ["accuracy", "size"], within_tolerance_only=True) == ["sharp"]
    assert _best(rows, ["sharp"], ["accuracy", "size"])["stage"] == "sharp"

    out = OutputAccuracy.model_construct(name="logits", cosine_mean=0.999)
    task = TaskAccuracy.model_construct(kind="classification", metrics={"top1_agreement": 0.9})
    accuracy = Accuracy.model_construct(reference="export", samples=8, outputs=[out], within_tolerance=True, task=task)
    latency = Latency.model_construct(batch_size=1, p50_ms=1.0)
    result = StageResult.model_construct(name="smooth", pass_name="int8", status="ok", accuracy=accuracy, latency=[latency], size_bytes=10)
    assert objective_values(result, ["accuracy", "latency"]) == [pytest.approx(0.9), 1.0]


def test_a_sampler_beside_a_grid_is_refused_not_ignored():
    with pytest.raises(RecipeError, match=r"evaluate\.search: sampler: nsga2 samples only with strategy optuna"):
        parse_recipe(_data({}, {"strategy": "grid", "sampler": "nsga2"}))
    assert parse_recipe(_data({}, {"strategy": "auto", "sampler": "nsga2"}))  # auto may pick optuna: kept
