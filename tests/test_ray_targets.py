"""Targets' resources on Ray, and `--only` outside the local pipeline, without starting Ray
(the 2-node cluster test, tests/test_ray_executor.py, runs them on a real cluster)."""
from __future__ import annotations

import io

import pytest

from optpipe.plan.compile_plan import CompilePlan
from optpipe.core.errors import RecipeError
from optpipe.execution.executors import LocalExecutor, Progress
from optpipe.execution.ray_targets import RayTargets
from optpipe.recipe.schema import TargetSpec
from optpipe.core.results import TargetResult
from optpipe.safety.recipe_loading import load_recipe
from optpipe.search.runner import compile_recipes
from optpipe.targets import TargetWork, target_resources


@pytest.mark.parametrize("spec, needs", [
    (TargetSpec(kind="ort"), {"CPU": 1}),  # no GPU asked: never waits for a GPU node
    (TargetSpec(kind="openvino"), {"CPU": 1}),
    (TargetSpec(kind="triton"), {"CPU": 1}),
    (TargetSpec(kind="tensorrt"), {"CPU": 1, "GPU": 1}),
    (TargetSpec(kind="triton", params={"platform": "tensorrt"}), {"CPU": 1, "GPU": 1}),  # builds the engine it serves
    (TargetSpec(kind="tensorrt", gpu_type="L40S"), {"CPU": 1, "GPU": 1, "gpu:l40s": 1}),
    (TargetSpec(kind="ort", gpu_type="a100-80gb"), {"CPU": 1, "GPU": 1, "gpu:a100-80gb": 1}),
])
def test_target_resources(spec, needs):
    assert target_resources(spec) == needs


@pytest.mark.parametrize("bad", ["H 200", "-l4", "gpu:h200", ""])
def test_a_gpu_type_that_is_no_name_is_one_line(tiny_recipe, bad):
    with pytest.raises(RecipeError) as err:
        load_recipe(tiny_recipe({"targets": [{"kind": "tensorrt", "gpu_type": bad}]}))
    assert "targets.0.gpu_type" in str(err.value) and "\n" not in str(err.value)


def test_a_gpu_type_is_checked_by_validate(tiny_recipe, cli_run):
    result = cli_run("validate", str(tiny_recipe({"targets": [{"kind": "tensorrt", "gpu_type": "h/200"}]})))
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "gpu_type" in result.output


class _Cluster:
    """Ray's node listing as RayTargets reads it, for a cluster described in the test."""

    def __init__(self, *nodes: dict):
        self._nodes = [{"Alive": True, "Resources": n} for n in nodes]

    def nodes(self):
        return self._nodes

    def cluster_resources(self):
        total: dict = {}
        for node in self._nodes:
            for key, value in node["Resources"].items():
                total[key] = total.get(key, 0) + value
        return total

    def remote(self, fn):
        return fn


def _refusal(cluster: _Cluster, spec: TargetSpec) -> str | None:
    targets = RayTargets(cluster, {"CPU": 2, "benchmark": 1}, None, None, None, Progress(io.StringIO()), 3)
    return targets._refusal(targets._needs(target_resources(spec)))


CPU_NODE = {"CPU": 2, "benchmark": 1}
L4_NODE = {"CPU": 4, "GPU": 1, "gpu:l4": 1, "benchmark": 1}


def test_a_gpu_type_no_node_has_names_the_resource_and_the_flag():
    line = _refusal(_Cluster(CPU_NODE, L4_NODE), TargetSpec(kind="tensorrt", gpu_type="h200"))
    assert "offers `gpu:h200`" in line and "`ray start --num-gpus=1 --resources='{\"gpu:h200\": 1, \"benchmark\": 1}'`" in line
    assert "\n" not in line


def test_no_gpu_at_all_asks_for_num_gpus():
    line = _refusal(_Cluster(CPU_NODE), TargetSpec(kind="tensorrt"))
    assert "offers `GPU`" in line and "`ray start --num-gpus=1 --resources='{\"benchmark\": 1}'`" in line


def test_resources_split_across_nodes_are_not_enough():
    # The cluster has a GPU and an l4 in total, but on no single node with a benchmark slot.
    cluster = _Cluster(CPU_NODE, {"CPU": 2, "GPU": 1, "benchmark": 1}, {"CPU": 2, "gpu:l4": 1})
    assert _refusal(cluster, TargetSpec(kind="tensorrt", gpu_type="l4")) is not None
    assert _refusal(_Cluster(CPU_NODE, L4_NODE), TargetSpec(kind="tensorrt", gpu_type="l4")) is None
    assert _refusal(_Cluster(CPU_NODE), TargetSpec(kind="ort")) is None  # a CPU target needs no GPU node


class _Submitting(_Cluster):
    """Also runs the task API as RayTargets uses it: every submitted task finishes at once, ok."""

    def __init__(self, *nodes: dict):
        super().__init__(*nodes)
        self.submitted: list[dict] = []
        self.works: dict = {}

    def put(self, value):
        return value

    def options(self, **options):
        self.submitted.append(options)
        return self

    def remote(self, *args):
        if callable(args[0]):  # ray.remote(fn): the task itself is this object
            return self
        ref = len(self.submitted)  # an ObjectRef stand-in
        self.works[ref] = args[2]
        return ref

    def wait(self, refs, num_returns, timeout):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        work = self.works[ref]
        return TargetResult(kind=work.spec.kind, stage=work.stage, status="ok"), None, 0.0


def test_refused_targets_fail_and_the_others_are_built():
    cluster = _Submitting(CPU_NODE)
    recipe = _named_recipe("r")
    targets = RayTargets(cluster, {"CPU": 2, "benchmark": 1}, recipe, None, None, Progress(io.StringIO()), 3)
    works = [TargetWork(0, TargetSpec(kind="tensorrt", gpu_type="h200"), "a"), TargetWork(1, TargetSpec(kind="ort"), "a")]
    results = targets(works, {})
    assert results[0].status == "failed" and "gpu:h200" in results[0].reason
    assert results[1].status == "ok"
    # Only the ORT target was submitted, and it asked for no GPU.
    assert cluster.submitted == [{"name": "target ort a", "max_retries": 3, "num_cpus": 2, "resources": {"benchmark": 1}}]


def _named_recipe(name: str):
    class Named:  # RayTargets reads only the plan's name (for progress lines) and ships it to its tasks
        pass

    recipe = Named()
    recipe.name = name
    return recipe


def test_a_stage_resource_no_node_has_names_the_flag(tiny_recipe, tmp_path):
    from optpipe.core.errors import OptpipeError
    from optpipe.execution.executors import Plan
    from optpipe.execution.ray_executor import RayExecutor
    from optpipe.execution.stage_tasks import TaskSettings

    executor = object.__new__(RayExecutor)  # without joining a cluster: only its resource check is under test
    executor.ray = _Cluster(CPU_NODE)
    recipe = load_recipe(tiny_recipe({"evaluate": {"resources": {"GPU": 1}}, "stages": {"simplify": {"resources": {"gpu:l4": 1}}}}))
    plan = Plan("tiny", CompilePlan.of(recipe), ["export", "simplify"], "export", False, TaskSettings(tmp_path / "cache", tmp_path / "run"), None)
    with pytest.raises(OptpipeError, match=r"evaluate.resources: GPU=1 but the Ray cluster has 0; start a node with it \(ray start --num-gpus=1\)"):
        executor._check_resources(plan)
    plan.compile_plan = CompilePlan.of(load_recipe(tiny_recipe({"stages": {"simplify": {"resources": {"gpu:l4": 1}}}})))
    with pytest.raises(OptpipeError, match=r"""stages.simplify.resources: gpu:l4=1 .*ray start --resources='\{"gpu:l4": 1\}'"""):
        executor._check_resources(plan)


def test_only_runs_the_stage_and_its_ancestors_outside_the_local_pipeline(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe({"stages": {"fp16": {"pass": "fp16", "after": "export"}}}))
    [(report, failed)] = compile_recipes([recipe], LocalExecutor(), cache_dir=tmp_path / "cache", output=tmp_path / "run",
                                         only="simplify", progress=Progress(io.StringIO()))
    assert [s.name for s in report.stages] == ["pytorch-eager", "export", "simplify"] and not failed


def test_only_with_a_search_is_one_line(cli_run, tiny_recipe):
    path = tiny_recipe({"stages": {"simplify": {"optional": True}}})
    result = cli_run("compile", str(path), "--only", "simplify")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "does not combine with searches" in result.output


def test_only_names_an_unknown_stage_before_ray_starts(cli_run, tiny_recipe, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # Ray must not even be imported
    result = cli_run("compile", str(tiny_recipe()), "--executor", "ray", "--only", "nope")
    assert result.exit_code == 2 and "--only: unknown stage 'nope'" in result.output
