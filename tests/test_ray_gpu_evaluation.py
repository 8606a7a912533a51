"""A GPU for evaluations that run on one (evaluate.providers), inferred for Ray tasks, without starting Ray."""
from __future__ import annotations

import io

import pytest

from optpipe.core.errors import OptpipeError, RecipeError
from optpipe.execution.executors import Plan, Progress, RunMemo
from optpipe.execution.ray_executor import RayExecutor, evaluation_resources
from optpipe.execution.stage_tasks import TaskSettings
from optpipe.plan.compile_plan import CompilePlan
from optpipe.recipe.schema import EvaluateSpec, TargetSpec
from optpipe.safety.recipe_loading import load_recipe
from optpipe.targets import target_resources


@pytest.mark.parametrize("evaluate, run, wanted", [
    ({}, "auto", {}),  # auto never asks: on Ray it evaluates on what the task is given
    ({"providers": "cpu"}, "auto", {}),
    ({"providers": "cuda"}, "auto", {"GPU": 1}),
    ({"providers": "tensorrt"}, "auto", {"GPU": 1}),
    ({}, "cuda", {"GPU": 1}),  # the Python API's providers= asks too
    ({"providers": "cuda"}, "cpu", {}),  # ... and wins over the recipe's
    ({"providers": "cuda", "resources": {"gpu:l4": 1}}, "auto", {"gpu:l4": 1, "GPU": 1}),
    ({"providers": "cuda", "resources": {"GPU": 2}}, "auto", {"GPU": 2}),  # declared wins
    ({"resources": {"GPU": 1}}, "auto", {"GPU": 1}),  # auto uses a GPU it is given
])
def test_evaluation_resources(evaluate, run, wanted):
    assert evaluation_resources(EvaluateSpec(**evaluate), run) == wanted


@pytest.mark.parametrize("evaluate, words", [
    ({"providers": "cuda", "resources": {"GPU": 0}}, "GPU=0 contradicts providers: cuda"),
    ({"providers": "tensorrt", "resources": {"GPU": 0}}, "GPU=0 contradicts providers: tensorrt"),
    ({"providers": "cpu", "resources": {"GPU": 1, "gpu:l4": 1}}, "GPU=1 contradicts providers: cpu"),
])
def test_providers_contradicting_resources_is_one_line(tiny_recipe, cli_run, evaluate, words):
    path = tiny_recipe({"evaluate": evaluate})
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert words in str(err.value) and "\n" not in str(err.value)
    result = cli_run("validate", str(path))
    assert result.exit_code == 2 and result.output.count("\n") == 1 and words in result.output


class _FakeRay:
    """Ray's task API as RayExecutor.run uses it; records each task's options, runs nothing."""

    def __init__(self, *nodes: dict):
        self._nodes = [{"Alive": True, "Resources": n} for n in nodes]
        self.options_of: dict[str, dict] = {}

    def nodes(self):
        return self._nodes

    def cluster_resources(self):
        total: dict = {}
        for node in self._nodes:
            for key, value in node["Resources"].items():
                total[key] = total.get(key, 0) + value
        return total

    def remote(self, fn):
        ray = self

        class Task:
            def options(self, **options):
                ray.options_of[options["name"]] = options
                return self

            def remote(self, *args):
                return object()

        return Task()

    def put(self, value):
        return value


def _submitted(tmp_path, recipe, *nodes, run_providers="auto") -> dict[str, dict]:
    executor = object.__new__(RayExecutor)  # without joining a cluster: what it submits is under test
    executor.ray = _FakeRay(*nodes)
    executor.timing_cpus = 2
    executor._pass, executor._eval = executor.ray.remote(None), executor.ray.remote(None)
    executor._collect = lambda waiting, progress: None
    settings = TaskSettings(cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", providers=run_providers)
    executor.run([Plan("tiny", CompilePlan.of(recipe), list(recipe.stages), "export", True, settings, RunMemo())], Progress(io.StringIO()))
    return executor.ray.options_of


CPU_NODE = {"CPU": 2, "benchmark": 1}
GPU_NODE = {"CPU": 4, "GPU": 1, "benchmark": 1}


def test_a_cuda_evaluation_asks_ray_for_a_gpu_and_passes_do_not(tiny_recipe, tmp_path):
    options = _submitted(tmp_path, load_recipe(tiny_recipe({"evaluate": {"providers": "cuda"}})), CPU_NODE, GPU_NODE)
    evaluations = {name: o for name, o in options.items() if name.startswith("evaluate ")}
    assert set(evaluations) == {"evaluate pytorch-eager", "evaluate export", "evaluate simplify"}
    assert all(o["num_gpus"] == 1 and o["resources"] == {"benchmark": 1} for o in evaluations.values())
    assert all("num_gpus" not in o for name, o in options.items() if name.startswith("pass "))


def test_a_cpu_evaluation_never_asks_for_a_gpu(tiny_recipe, tmp_path):
    for evaluate in ({}, {"providers": "cpu"}):
        options = _submitted(tmp_path, load_recipe(tiny_recipe({"evaluate": evaluate})), CPU_NODE, GPU_NODE)
        assert options and all("num_gpus" not in o for o in options.values())


def test_a_gpu_evaluation_on_a_cluster_without_gpus_names_the_provider(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe({"evaluate": {"providers": "tensorrt"}}))
    with pytest.raises(OptpipeError, match=r"^evaluate.providers: tensorrt \(a GPU per evaluation\): GPU=1 but the Ray cluster "
                                           r"has 0; start a node with it \(ray start --num-gpus=1\) or set evaluate.providers: cpu$"):
        _submitted(tmp_path, recipe, CPU_NODE)


@pytest.mark.parametrize("spec, on_gpu", [
    (TargetSpec(kind="ort"), True),  # timed through ORT where the stages were: on the GPU
    (TargetSpec(kind="triton"), True),
    (TargetSpec(kind="openvino"), False),  # OpenVINO times on the CPU whatever the stages used
    (TargetSpec(kind="triton", params={"platform": "openvino"}), False),
])
def test_targets_follow_a_gpu_evaluation_except_openvino(spec, on_gpu):
    assert ("GPU" in target_resources(spec, evaluation_on_gpu=True)) is on_gpu
    assert "GPU" not in target_resources(spec)


def test_a_triton_model_served_on_gpu_is_timed_on_one():
    assert target_resources(TargetSpec(kind="triton", params={"device": "gpu"})) == {"CPU": 1, "GPU": 1}


def test_evaluate_providers_reach_onnxruntime(monkeypatch, caplog):
    """On a machine with CUDA and TensorRT providers (faked), the recipe's choice picks the session's providers."""
    import onnxruntime as ort

    from optpipe.core import runtime
    from optpipe.evaluation.evaluator import Evaluator

    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(runtime, "cuda_available", lambda: True)
    runtime._fell_back.cache_clear()  # said once per process: this test must see it said

    def providers(recipe: str, run: str = "auto") -> list[str]:
        return Evaluator(EvaluateSpec(providers=recipe), None, None, None, run).providers

    assert providers("auto") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers("cpu") == ["CPUExecutionProvider"]
    assert providers("tensorrt") == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers("tensorrt", run="cpu") == ["CPUExecutionProvider"]
    assert not caplog.records
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert providers("tensorrt") == ["CUDAExecutionProvider", "CPUExecutionProvider"]  # no TensorRT provider: CUDA, and said
    monkeypatch.setattr(runtime, "cuda_available", lambda: False)  # no device: the CPU, and said
    assert providers("cuda") == ["CPUExecutionProvider"]
    assert [r.getMessage() for r in caplog.records] == [
        "evaluate.providers: tensorrt, but ONNX Runtime here has no TensorRT provider; evaluating with CUDAExecutionProvider "
        "(the report's provider column says so)",
        "evaluate.providers: cuda, but ONNX Runtime here has no usable CUDA device; evaluating with CPUExecutionProvider "
        "(the report's provider column says so)"]
