"""The Ray executor on a real cluster (a head and two worker nodes), kept on loopback inside a network namespace.

Ray's daemons advertise the machine's interface address even with --node-ip-address=127.0.0.1;
here the cluster and the driver run in `unshare --net` (loopback only) plus a PID namespace,
whose end kills every process of the cluster, also when the test fails or times out.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optpipe.execution.executors import LocalExecutor, Progress
from optpipe.search.runner import compile_recipes
from optpipe.safety.recipe_loading import load_recipe
from optpipe.core.results import RunReport

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = ["unshare", "--net", "--pid", "--fork", "--mount-proc"]


def _namespaces_allowed() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare --net is not permitted here: {probe.stderr.strip()[:100]}"


def _tiny_search(tmp_path: Path) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "tiny-search.yaml").read_text())
    data["model"]["path"] = str(REPO / "recipes" / "models")
    data["output"] = "run"
    path = tmp_path / "tiny-search.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _tiny_targets(tmp_path: Path) -> Path:
    """The tiny search's chain as a plain recipe, with targets that ask for a GPU type the test
    cluster has (`testgpu`), one it lacks (`h200`), and none (ORT)."""
    data = yaml.safe_load((REPO / "recipes" / "tiny-search.yaml").read_text())
    data.update(name="tiny-targets", output="targets-run")
    data["model"]["path"] = str(REPO / "recipes" / "models")
    for stage in data["stages"].values():
        stage.pop("optional", None)
        for key, choices in stage.pop("search", {}).items():
            stage.setdefault("params", {})[key] = choices[0]
    del data["evaluate"]["search"]
    data["targets"] = [{"kind": "ort", "stages": ["simplify"]},
                       {"kind": "tensorrt", "stages": ["prune"], "gpu_type": "testgpu"},
                       {"kind": "tensorrt", "stages": ["simplify"], "gpu_type": "H200"}]
    path = tmp_path / "tiny-targets.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.ray
def test_search_on_a_two_node_cluster_survives_a_killed_driver_and_worker_and_matches_the_local_run(tmp_path):
    pytest.importorskip("ray")
    reason = _namespaces_allowed()
    if reason:
        pytest.skip(reason)
    recipe = _tiny_search(tmp_path)
    ray_run, ray_cache, targets_run = tmp_path / "ray-run", tmp_path / "ray-cache", tmp_path / "targets-run"
    proc = subprocess.run(
        [*NAMESPACE, sys.executable, str(REPO / "tests" / "ray_cluster_run.py"), str(recipe), str(ray_run), str(ray_cache), "3", "2",
         str(REPO / "recipes" / "models"), str(_tiny_targets(tmp_path)), str(targets_run)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    log = "\n".join(out["lines"])
    assert out["first_returncode"] != 0 and sum(" ok pass " in x for x in out["first_lines"]) == 3, out["first_lines"]
    assert out["returncode"] == 0, log
    # The rerun took what the killed driver had finished from the cache.
    assert sum(" cached pass " in line for line in out["lines"]) >= 3, log
    # The worker node ran stages, then died while the run still had work to do.
    assert out["killed_at"] is not None and out["killed_at"] < len(out["lines"]) - 3, log
    assert any(out["worker"] in line for line in out["lines"][: out["killed_at"]])
    assert "done: 1 recipe" in log and "search tiny-search: 9 trials" in log

    # The same search with the local executor, on its own cache: the same report.
    local_run = tmp_path / "local-run"
    [(local, _)] = compile_recipes([load_recipe(recipe)], LocalExecutor(), cache_dir=tmp_path / "local-cache",
                                   output=local_run, progress=Progress(open("/dev/null", "w")))
    remote = RunReport.model_validate_json((ray_run / "report.json").read_text())
    assert [(t["stage"], t["params"], t["status"]) for t in remote.search["trials"]] == \
           [(t["stage"], t["params"], t["status"]) for t in local.search["trials"]]
    assert remote.search["frontier"] == local.search["frontier"] and remote.search["frontier"]
    for a, b in zip(remote.stages, local.stages):
        assert a.name == b.name and a.status == b.status
        if a.accuracy:
            assert a.accuracy.model_dump() == b.accuracy.model_dump(), a.name
    # Every figure says which node measured it. Which node that is stays Ray's choice: after the
    # worker is killed the head may measure everything (seen under load), so no count of nodes is asserted.
    measured = [s for s in remote.stages if s.latency]
    assert measured and all(s.measured_on and s.measured_on.get("ray_node") for s in measured)
    assert remote.hardware["classes"] and "frontier" not in remote.hardware  # one kind of machine: one frontier

    # 3. Targets as Ray tasks, with --only: the TensorRT target for GPU type `testgpu` ran on the
    # node that declares it (TensorRT itself is missing here: its build ends with that reason); the
    # one for `h200`, which no node has, failed at once with the flag to add; the ORT target asked
    # for no GPU and was built.
    log = "\n".join(out["targets_lines"])
    assert out["targets_returncode"] == 1, log
    run = RunReport.model_validate_json((targets_run / "report.json").read_text())
    assert [s.name for s in run.stages] == ["pytorch-eager", "export", "simplify", "prune"], log  # --only prune
    targets = {(t.kind, t.stage): t for t in run.targets}
    engine = targets["tensorrt", "prune"]
    assert engine.status == "skipped" and "TensorRT is not installed" in engine.reason, engine
    assert engine.built_on["ray_node"] == out["gpu_node"], (engine.built_on, out["gpu_node"])
    absent = targets["tensorrt", "simplify"]
    assert absent.status == "failed" and absent.built_on is None
    assert "offers `gpu:h200`" in absent.reason and "`ray start --num-gpus=1 --resources='{\"gpu:h200\": 1, \"benchmark\": 1}'`" in absent.reason
    assert sum("gpu:h200" in line for line in out["targets_lines"]) == 2, log  # its progress line and its error line
    assert targets["ort", "simplify"].status == "ok" and targets["ort", "simplify"].built_on["ray_node"], log
    manifest = json.loads((targets_run / "manifest.json").read_text())
    assert {(a["target"], a["stage"]): a["built_on"] for a in manifest["artifacts"]}["tensorrt", "prune"] == engine.built_on


def test_unreachable_address_is_one_line_exit_2(tiny_recipe, cli_run):
    pytest.importorskip("ray")
    result = cli_run("compile", str(tiny_recipe()), "--executor", "ray", "--address", "127.0.0.1:1")
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "nothing answers at 127.0.0.1:1" in result.output


def test_ray_missing_is_one_line_exit_2(tiny_recipe, cli_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray then raises ImportError
    result = cli_run("compile", str(tiny_recipe()), "--executor", "ray")
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "pip install 'optpipe[ray]'" in result.output


def test_address_without_ray_executor_is_a_usage_error(tiny_recipe, cli_run):
    result = cli_run("compile", str(tiny_recipe()), "--address", "auto")
    assert result.exit_code == 2 and "--executor ray" in result.output


def test_recipe_resources_become_ray_task_options(tiny_recipe):
    from optpipe.execution.ray_executor import _ray_resources

    recipe = load_recipe(tiny_recipe({"stages": {"simplify": {"resources": {"CPU": 2, "GPU": 1, "gpu-L4": 1}}},
                                      "evaluate": {"resources": {"GPU": 1, "gpu-L4": 1}}}))
    assert _ray_resources(recipe.stages["simplify"].resources) == {"num_cpus": 2, "num_gpus": 1, "resources": {"gpu-L4": 1}}
    assert _ray_resources(recipe.stages["export"].resources) == {"num_cpus": 1}  # no GPU asked: never waits for one
    assert _ray_resources(recipe.evaluate.resources) == {"num_cpus": 1, "num_gpus": 1, "resources": {"gpu-L4": 1}}
