"""Search spaces: the space and its trials, grid and Optuna runs on the tiny MLP, reuse of
finished trials, widening, failed trials, the --yes limit, and the report's search section."""
from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from optpipe.core.errors import RecipeError
from optpipe.execution.executors import LocalExecutor, Progress
from optpipe.search.runner import compile_recipes
from optpipe.safety.recipe_loading import load_recipe, parse_recipe
from optpipe.search.space import SearchSpace
from optpipe.recipe.search_spec import StepRange
from optpipe.search.strategies import resolve_strategy
from optpipe.recipe.search_spec import SearchSettings

REPO = Path(__file__).resolve().parents[1]
TINY_SEARCH = REPO / "recipes" / "tiny-search.yaml"


def _recipe_data(**stage_overrides) -> dict:
    data = yaml.safe_load(TINY_SEARCH.read_text())
    data["model"]["path"] = str(REPO / "recipes" / "models")
    data["evaluate"].update(batch_sizes=[1], warmup=1, iterations=3)  # the figures' meaning is not under test
    for name, spec in stage_overrides.items():
        if spec is None:
            data["stages"].pop(name)
        else:
            data["stages"][name] = spec
    return data


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the module: the export of the MLP is made once; each test's stages differ."""
    return tmp_path_factory.mktemp("search-cache")


def _write(tmp_path: Path, data: dict, name: str = "search.yaml") -> Path:
    data = copy.deepcopy(data)
    data["output"] = str(tmp_path / "run")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _run(path: Path, cache: Path, yes: bool = False):
    stream = io.StringIO()
    recipe = load_recipe(path)
    [(report, failed)] = compile_recipes([recipe], LocalExecutor(), cache_dir=cache, yes=yes, progress=Progress(stream))
    return report, failed, stream.getvalue()


def _computed(progress: str) -> set[str]:
    """Stages whose pass ran (not a cache hit) in a run's progress lines."""
    return set(re.findall(r"^\s+ok pass (\S+)", progress, re.M))


# --- the space -------------------------------------------------------------------------------


def test_range_with_a_step_gives_the_values_a_user_writes():
    assert StepRange(min=0.1, max=0.5, step=0.1).values() == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert StepRange(min=0, max=12, step=4).values() == [0, 4, 8, 12]
    assert StepRange(min=99.9, max=99.99, step=0.03).values() == [99.9, 99.93, 99.96, 99.99]


def test_optional_stage_off_is_one_point_and_the_chain_reattaches():
    recipe = parse_recipe(_recipe_data(), base_dir=REPO / "recipes")
    space = SearchSpace(recipe)
    # prune: off | 0.2 | 0.5 ; int8: off | per channel | per tensor
    assert space.size == 9 and len(list(space.grid())) == 9
    expanded, leaves = space.expand(space.grid())
    off_off = next(t for t in leaves if not t.get("prune.enabled") and not t.get("int8.enabled"))
    assert leaves[off_off] == "simplify"
    int8_only = next(t for t in leaves if not t.get("prune.enabled") and t.get("int8.enabled") and t.get("int8.per_channel"))
    assert expanded.stages[leaves[int8_only]].after == "simplify"
    both = next(t for t in leaves if t.get("prune.enabled") and t.get("int8.enabled"))
    int8_stage = expanded.stages[leaves[both]]
    assert int8_stage.params["mode"] == "dynamic" and "per_channel" in int8_stage.params
    assert expanded.stages[int8_stage.after].params["amount"] == both.get("prune.amount")


@pytest.mark.parametrize("stages, message", [
    ({"int8": {"pass": "int8", "after": "prune", "params": {"mode": "dynamic", "per_channel": True}, "search": {"per_channel": [True, False]}}},
     "also set in params"),
    ({"other": {"pass": "int8", "after": "prune", "params": {"mode": "dynamic"}}}, "must form one chain"),
    ({"int8": {"pass": "int8", "after": "prune", "search": {"method": ["minmax", "histogram"]}}}, "method"),
])
def test_bad_spaces_are_one_line_errors(tmp_path, cache_dir, stages, message):
    path = _write(tmp_path, _recipe_data(**stages))
    with pytest.raises(RecipeError, match=message):
        _run(path, cache_dir)


def test_empty_choices_are_a_recipe_error(tmp_path):
    data = _recipe_data(int8={"pass": "int8", "after": "prune", "search": {"per_channel": []}})
    with pytest.raises(RecipeError, match=r"stages\.int8\.search.*no choices"):
        parse_recipe(data)


def test_big_grid_without_budget_asks_for_yes_and_counts_the_trials():
    data = _recipe_data(int8={"pass": "int8", "after": "prune", "params": {"mode": "static"},
                              "search": {"max_excluded": {"min": 0, "max": 40, "step": 1}, "per_channel": [True, False]}})
    space = SearchSpace(parse_recipe(data))
    assert space.size == 3 * 41 * 2  # prune off|0.2|0.5 x max_excluded x per_channel
    with pytest.raises(RecipeError, match=rf"the grid has {space.size} trials.*--yes"):
        resolve_strategy(space, SearchSettings(strategy="grid"), yes=False)
    assert resolve_strategy(space, SearchSettings(strategy="grid"), yes=True) == ("grid", None)
    assert resolve_strategy(space, SearchSettings(strategy="grid", trials=10), yes=False) == ("grid", 10)
    assert resolve_strategy(space, SearchSettings(), yes=False) == ("optuna", 64)  # auto: too big for a grid


def test_cli_big_grid_exits_2_with_one_line(tmp_path, cli_run):
    data = _recipe_data(int8={"pass": "int8", "after": "prune", "params": {"mode": "dynamic"},
                              "search": {"per_channel": [True, False], "reduce_range": [True, False]}},
                        prune={"pass": "prune", "after": "simplify", "params": {"method": "magnitude"},
                               "search": {"amount": {"min": 0.01, "max": 0.5, "step": 0.01}}})
    result = cli_run("compile", str(_write(tmp_path, data)))
    assert result.exit_code == 2
    assert "200 trials" in result.output and "--yes" in result.output and len(result.output.strip().splitlines()) == 1


# Each way a searched value can be bad, with the line of the recipe the user must change: the
# recipe's own `stages.STAGE.search.PARAM`, never a trial stage it expands into (`int8__method-kl...`).
_PRUNE = {"pass": "prune", "after": "simplify"}
_INT8 = {"pass": "int8", "after": "prune"}
BAD_SEARCHED_VALUES = {
    "unknown choice": ({"int8": {**_INT8, "params": {"mode": "static"}, "search": {"per_channel": [True, False], "method": ["minmax", "kl"]}}},
                       r"stages\.int8\.search\.method: Input should be 'minmax', 'entropy' or 'percentile' \(got 'kl'\)"),
    "out of range (a step range)": ({"prune": {**_PRUNE, "params": {"method": "magnitude"}, "search": {"amount": {"min": 0.5, "max": 1.5, "step": 0.5}}}},
                                    r"stages\.prune\.search\.amount: Input should be less than 1 \(got 1\.0\)"),
    "wrong type": ({"int8": {**_INT8, "params": {"mode": "dynamic"}, "search": {"reduce_range": [False, "sometimes"]}}},
                   r"stages\.int8\.search\.reduce_range: Input should be a valid boolean"),
    "unknown key": ({"int8": {**_INT8, "params": {"mode": "dynamic"}, "search": {"per_chanel": [True, False]}}},
                    r"stages\.int8\.search\.per_chanel: unknown key \(did you mean 'per_channel'\?\)"),
    "refused beside a fixed param": ({"prune": {**_PRUNE, "params": {"method": "2:4"}, "search": {"amount": [0.5, 0.3]}}},
                                     r"stages\.prune\.search\.amount: choice 0\.3 is refused: 2:4 sparsity always removes half"),
    "refused beside another searched value": ({"prune": {**_PRUNE, "search": {"amount": [0.2, 0.5], "method": ["magnitude", "2:4"]}}},
                                              r"stages\.prune\.search\.amount: choice 0\.2 is refused beside method='2:4': 2:4 sparsity"),
    "refused by a recipe rule": ({"int8": {**_INT8, "search": {"mode": ["dynamic", "static"]}}},
                                 r"stages\.int8\.search\.mode \(choice 'static'\): static int8 calibrates on data"),
}


@pytest.mark.parametrize("strategy", ["grid", "optuna"])
@pytest.mark.parametrize("case", list(BAD_SEARCHED_VALUES))
def test_a_bad_searched_value_names_the_recipes_own_line(tmp_path, cli_run, case, strategy):
    stages, message = BAD_SEARCHED_VALUES[case]
    data = _recipe_data(**copy.deepcopy(stages))
    data["evaluate"]["search"] = {"strategy": strategy, "trials": 4, "objectives": ["accuracy", "size"]}
    path = _write(tmp_path, data)
    for command in ("validate", "compile"):
        result = cli_run(command, str(path))
        assert result.exit_code == 2, (command, result.output)
        [line] = result.output.strip().splitlines()
        assert re.search(message, line), (command, line)
        assert "__" not in line, line  # no expanded trial stage in the message
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_a_space_too_big_to_check_whole_has_each_proposed_trial_checked(monkeypatch):
    import optpipe.search.checks as checks

    monkeypatch.setattr(checks, "MAX_COMBINATIONS", 3)  # 2 x 2 choices: only each value beside the others' first
    data = _recipe_data(int8=None, prune={**_PRUNE, "search": {"amount": [0.5, 0.2], "method": ["magnitude", "2:4"]}})
    space = SearchSpace(parse_recipe(data, base_dir=REPO / "recipes"))
    checks.check_searched_values(space)  # (0.2, 2:4) is no probe: not seen before the search
    with pytest.raises(RecipeError, match=r"^stages\.prune\.search\.(amount: choice 0\.2|method: choice '2:4') is refused beside"):
        for trial in space.grid():
            checks.check_trial(space, trial)


# --- runs ------------------------------------------------------------------------------------


def test_grid_search_reports_every_trial_reuses_them_and_widens_incrementally(tmp_path, cache_dir, cli_run):
    path = _write(tmp_path, _recipe_data())
    report, failed, progress = _run(path, cache_dir)
    search = report.search
    assert failed == []
    assert len(search["trials"]) == 9 and search["strategy"] == "grid"
    statuses = {t["number"]: t["status"] for t in search["trials"]}
    # Half the weights zeroed breaks cosine 0.95 on this MLP (measured 0.889); a fifth does not (0.990).
    assert {statuses[t["number"]] for t in search["trials"] if t["params"].get("prune.amount") == 0.5} == {"out of tolerance"}
    assert search["frontier"] and all(name in {t["stage"] for t in search["trials"]} for name in search["frontier"])
    best = next(t for t in search["trials"] if t["number"] == search["best"]["number"])
    candidates = [t for t in search["trials"] if t["stage"] in search["frontier_within_tolerance"]]
    assert best["status"] == "ok" and best["stage"] in search["frontier_within_tolerance"]
    assert best["size_bytes"] == min(t["size_bytes"] for t in candidates)  # objectives: accuracy, size
    effects = search["effects"]["prune.amount"]
    assert [(e["value"], e["trials"], e["within_tolerance"]) for e in effects] == [(0.2, 3, 3), (0.5, 3, 0)]
    run_dir = tmp_path / "run"
    md = (run_dir / "report.md").read_text()
    assert "## Search" in md and "Effect of each param" in md and "out of tolerance" in md
    assert "budget: none; stopped:" in md  # not "none trials, no s wall"
    assert "Search" in (run_dir / "report.html").read_text()
    assert json.loads((run_dir / "report.json").read_text())["search"]["trials"][0]["params"]

    # A rerun computes nothing: every trial is a cache hit, and the report is the same.
    again, _, progress = _run(path, cache_dir)
    assert _computed(progress) == set()
    assert [t["stage"] for t in again.search["trials"]] == [t["stage"] for t in search["trials"]]
    assert again.search["frontier"] == search["frontier"]

    # Widening the space computes only its new points.
    wider = _recipe_data()
    wider["stages"]["prune"]["search"]["amount"] = [0.2, 0.3, 0.5]
    widened, _, progress = _run(_write(tmp_path, wider), cache_dir)
    assert len(widened.search["trials"]) == 12
    assert _computed(progress) == {"prune__amount-0.3", "int8__amount-0.3__per_channel-True", "int8__amount-0.3__per_channel-False"}

    listing = cli_run("inspect", str(run_dir), cache=cache_dir)
    assert listing.exit_code == 0 and "trial  12" in listing.output and "*best*" in listing.output


def test_failed_trials_are_reported_and_the_search_goes_on(tmp_path, cache_dir):
    # Structured pruning finds no channel group in this MLP (GELU + LayerNorm between the Linears).
    data = _recipe_data(prune={"pass": "prune", "after": "simplify", "params": {"amount": 0.2},
                               "search": {"method": ["structured", "magnitude"]}}, int8=None)
    report, failed, _ = _run(_write(tmp_path, data), cache_dir)
    trials = {t["params"]["prune.method"]: t for t in report.search["trials"]}
    assert trials["structured"]["status"] == "failed" and "no channel group" in trials["structured"]["reason"]
    assert trials["magnitude"]["status"] == "ok"
    assert failed == []  # a failed trial is a search result, not a failed run


def test_optuna_nsga2_within_a_trial_budget_is_repeatable(tmp_path, cache_dir):
    data = _recipe_data()
    data["evaluate"]["search"] = {"strategy": "optuna", "sampler": "nsga2", "trials": 5, "seed": 3,
                                  "objectives": ["latency", "accuracy", "size"]}
    path = _write(tmp_path, data)
    first, _, _ = _run(path, cache_dir)
    # The budget counts distinct points: a point NSGA-II proposes again is listed, measured once, not counted.
    distinct = [t for t in first.search["trials"] if t["repeat_of"] is None]
    assert len(distinct) == 5 and len({json.dumps(t["params"], sort_keys=True) for t in distinct}) == 5
    assert first.search["sampler"] == "nsga2"
    assert first.search["stopped"] == "budget of 5 trials spent"
    second, _, progress = _run(path, cache_dir)
    assert [t["params"] for t in second.search["trials"]] == [t["params"] for t in first.search["trials"]]
    assert _computed(progress) == set()


# --- figures from several kinds of machine ----------------------------------------------------


def _measured(name: str, p50: float, size: int, cpu: str, cosine: float = 1.0):
    from optpipe.core.results import Accuracy, Latency, OutputAccuracy, StageResult

    accuracy = Accuracy(reference="export", samples=4, within_tolerance=True,
                        outputs=[OutputAccuracy(name="y", max_abs=0.01, mean_abs=0.001, cosine_mean=cosine, cosine_min=cosine)])
    lat = Latency(batch_size=1, shape={}, p50_ms=p50, p90_ms=p50, p99_ms=p50, mean_ms=p50, throughput=1 / p50,
                  iterations=3, provider="CPUExecutionProvider")
    return StageResult(name=name, pass_name="int8", status="ok", latency=[lat], size_bytes=size, accuracy=accuracy,
                       measured_on={"host": cpu, "cpu": cpu, "cores": 8, "gpu": []})


def test_one_frontier_across_kinds_of_machine_is_refused_unless_grouped():
    from optpipe.execution.fan_out import frontier_by_hardware
    from optpipe.core.results import RunReport

    def report():
        # a faster, b more accurate: both on the (latency, accuracy error) frontier of the Xeon.
        stages = [_measured("a", 1.0, 100, "Xeon", cosine=0.995), _measured("b", 2.0, 50, "Xeon"), _measured("c", 0.5, 100, "EPYC")]
        return RunReport(optpipe_version="t", recipe="r", created="now", machine={}, evaluation={}, reference=None,
                         stages=stages, pareto=["a", "b", "c"])

    refused = report()
    hardware = frontier_by_hardware(refused, group_by_node=False)
    assert hardware["frontier"] == "refused" and "2 kinds of machine" in hardware["reason"]
    assert refused.pareto == [] and not any(s.pareto for s in refused.stages)
    assert "rerun with --group-by-node" in "\n".join(__import__("optpipe.reporting.search_views", fromlist=["x"]).render_search_markdown(None, hardware))

    grouped = report()
    hardware = frontier_by_hardware(grouped, group_by_node=True)
    assert hardware["frontiers"] == {"Xeon x8 / no GPU": ["a", "b"], "EPYC x8 / no GPU": ["c"]}
    assert sorted(grouped.pareto) == ["a", "b", "c"]

    same = RunReport(optpipe_version="t", recipe="r", created="now", machine={}, evaluation={}, reference=None,
                     stages=[_measured("a", 1.0, 100, "Xeon"), _measured("b", 2.0, 100, "Xeon")], pareto=["a"])
    assert frontier_by_hardware(same, group_by_node=False) == {"classes": ["Xeon x8 / no GPU"]} and same.pareto == ["a"]


def test_a_new_budget_or_strategy_reuses_every_measured_trial(tmp_path, cache_dir):
    data = _recipe_data()
    data["evaluate"]["search"] = {"strategy": "grid", "trials": 3, "seed": 1, "objectives": ["accuracy", "size"]}
    first, _, _ = _run(_write(tmp_path, data), cache_dir)
    data["evaluate"]["search"]["trials"] = 5  # the same seeded sample and two more... or others: either way,
    second, _, progress = _run(_write(tmp_path, data), cache_dir)  # what was measured is not measured again
    measured_again = set(re.findall(r"^\s+ok evaluate (\S+)", progress, re.M))
    assert not measured_again & {t["stage"] for t in first.search["trials"]}
    assert len(second.search["trials"]) == 5


def test_a_spent_wall_time_budget_starts_no_new_trial(tmp_path, cache_dir):
    data = _recipe_data()
    data["evaluate"]["search"] = {"strategy": "grid", "wall_time_s": 0.001, "objectives": ["accuracy", "size"]}
    report, _, _ = _run(_write(tmp_path, data), cache_dir)
    # The first round (one trial on the local executor) always runs; then the budget is spent.
    assert len(report.search["trials"]) == 1 and report.search["stopped"] == "wall-time budget of 0.001s spent"
