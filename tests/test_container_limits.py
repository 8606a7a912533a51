"""A container's memory limit and CPU quota, read from its cgroup files: the preflight, the thread cap and the
report use them where /proc/meminfo and the CPU count describe the host (optpipe/hardware/container_limits.py)."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from optpipe.core.errors import UserInputError
from optpipe.hardware import container_limits
from optpipe.hardware.container_limits import ContainerLimits, read_limits
from optpipe.safety import memory_estimate, resource_bounds
from helpers_recipes import small_recipe

GB = 1 << 30


def _proc(tmp_path: Path, cgroup: str, mounts: list[tuple[str, Path, str, str]]) -> Path:
    """A fake /proc/self: its cgroup file, and a mountinfo with (root, mount point, fstype, super options) rows."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    rows = [f"{30 + i} 23 0:{40 + i} {root} {point} rw,relatime - {fstype} {fstype} {options}"
            for i, (root, point, fstype, options) in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(["22 1 8:1 / / rw - ext4 /dev/vda rw", *rows]) + "\n")
    return proc


def _files(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text + "\n")


def test_cgroup_v1_limits_of_a_docker_container(tmp_path):
    memory, cpu = tmp_path / "memory", tmp_path / "cpu,cpuacct"
    own = "/docker/4f1e"
    _files(memory, memory__limit_in_bytes=str(2 ** 63 - 4096))  # the host's root: no limit
    _files(memory / "docker" / "4f1e", memory__limit_in_bytes=str(6 * GB), memory__usage_in_bytes=str(3 * GB),
           memory__stat=f"total_cache {2 * GB}\ntotal_active_file {GB}\ntotal_inactive_file {GB // 2}\n"
                        f"hierarchical_memory_limit {6 * GB}")
    _files(cpu / "docker" / "4f1e", cpu__cfs_quota_us="150000", cpu__cfs_period_us="100000")
    _files(cpu, cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    proc = _proc(tmp_path, f"12:memory:{own}\n4:cpu,cpuacct:{own}\n1:name=systemd:{own}\n",
                 [("/", memory, "cgroup", "rw,memory"), ("/", cpu, "cgroup", "rw,cpu,cpuacct")])
    limits = read_limits(proc)
    assert limits.memory_limit == 6 * GB
    assert limits.memory_used == 3 * GB - GB - GB // 2  # its file pages are reclaimed before anything is killed
    assert limits.memory_available() == 6 * GB - limits.memory_used
    assert limits.cpu_quota == 1.5 and limits.cores() == 1  # 2 threads would be throttled in every period
    assert limits.record() == {"memory_limit_bytes": 6 * GB, "cpu_quota": 1.5}


def test_cgroup_v2_takes_the_tightest_limit_up_to_the_mount(tmp_path):
    unified = tmp_path / "unified"
    pod = unified / "kubepods.slice" / "pod7"
    _files(unified, cgroup__controllers="cpu memory")  # the root holds no limit files
    _files(unified / "kubepods.slice", memory__max="max", cpu__max="max 100000")
    _files(pod, memory__max=str(4 * GB), cpu__max="100000 100000")  # the pod's limit binds its container
    _files(pod / "app", memory__max=str(8 * GB), memory__current=str(GB), cpu__max="max 100000",
           memory__stat=f"anon {GB // 2}\nactive_file {GB // 4}\ninactive_file {GB // 4}")
    proc = _proc(tmp_path, "0::/kubepods.slice/pod7/app\n", [("/", unified, "cgroup2", "rw,nsdelegate")])
    limits = read_limits(proc)
    assert limits.memory_limit == 4 * GB
    assert limits.memory_used == GB // 2
    assert limits.cpu_quota == 1.0 and limits.cores() == 1


@pytest.mark.parametrize("cgroup, root", [
    ("0::/\n", "/"),  # a private cgroup namespace: the container's cgroup is "/" and is the mount's root
    ("0::/system.slice/docker-4f1e.scope\n", "/system.slice/docker-4f1e.scope"),  # its own cgroup bound at the root
    ("0::/elsewhere\n", "/system.slice/docker-4f1e.scope"),  # a path the mount does not show: the mount's root
])
def test_a_containers_own_cgroup_at_the_mount_root(tmp_path, cgroup, root):
    unified = tmp_path / "unified"
    _files(unified, memory__max=str(3 * GB), memory__current=str(GB), cpu__max="200000 100000")
    limits = read_limits(_proc(tmp_path, cgroup, [(root, unified, "cgroup2", "rw")]))
    assert (limits.memory_limit, limits.cpu_quota) == (3 * GB, 2.0)


@pytest.mark.parametrize("layout", ["unlimited", "no-cgroup-fs", "no-proc"])
def test_no_limit_set_or_nothing_to_read_is_no_limit(tmp_path, layout):
    unified = tmp_path / "unified"
    _files(unified, memory__max="max", memory__current=str(GB), cpu__max="max 100000")
    mounts = [] if layout == "no-cgroup-fs" else [("/", unified, "cgroup2", "rw")]
    proc = tmp_path / "missing" if layout == "no-proc" else _proc(tmp_path, "0::/\n", mounts)
    limits = read_limits(proc)
    assert limits == ContainerLimits(None, None, None)
    assert limits.memory_available() is None and limits.cores() is None and limits.record() == {}


def test_the_preflight_refuses_in_the_containers_memory_and_says_whose(monkeypatch):
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(3 * GB, GB // 2, None))
    own = memory_estimate._held_by_this_process()
    assert own > 0  # this process's libraries: counted in each estimate's baseline, so not as used by someone else
    # Within a few pages: the process's resident set moves between two reads (4 KB apart in one run under load).
    assert abs(memory_estimate.available_bytes() - (3 * GB - GB // 2 + own)) <= 1 << 20
    monkeypatch.setattr(memory_estimate, "_held_by_this_process", lambda: 0)
    with pytest.raises(UserInputError) as refused:
        memory_estimate.check_fits(2 * GB, {"int8": "int8"})
    assert "in this container (its cgroup memory limit is 3.2 GB)" in str(refused.value)
    assert resource_bounds.memory_budget() <= 3 * GB // 2  # inputs alone: half of the container's memory


def test_threads_are_capped_to_the_cpu_quota_and_the_report_says_the_limits(monkeypatch, caplog):
    from optpipe.recipe.schema import Recipe
    from optpipe.reporting.run_report import machine_description

    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(6 * GB, GB, 1.0))
    recipe = Recipe.model_validate({**small_recipe({"onnx": "m.onnx"}), "evaluate": {"threads": 2}})
    with caplog.at_level(logging.WARNING):
        resource_bounds.check_resources(recipe, "recipe.yaml")
    assert recipe.evaluate.threads == 1
    assert "this container's CPU quota is 1 CPUs" in caplog.text
    assert machine_description()["container"] == {"memory_limit_bytes": 6 * GB, "cpu_quota": 1.0}


def test_a_quota_under_one_cpu_is_said_before_anything_is_timed(monkeypatch, caplog):
    from optpipe.recipe.schema import Recipe

    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(None, None, 0.5))
    recipe = Recipe.model_validate({**small_recipe({"onnx": "m.onnx"}), "evaluate": {"threads": 1}})
    with caplog.at_level(logging.WARNING):
        resource_bounds.check_resources(recipe, "recipe.yaml")
    assert recipe.evaluate.threads == 1
    assert "CPU quota is 0.5 CPUs, under one: every latency figure includes the quota's waits" in caplog.text


def _writable_v1(controller: str, probe: str) -> Path | None:
    root = Path("/sys/fs/cgroup") / controller
    return root if (root / probe).exists() and os.access(root, os.W_OK) else None


def _run_in_new_cgroup(root: Path, settings: dict[str, str], code: str) -> str:
    """`code`'s output, run by a process that joined a new cgroup under `root` with `settings` written first (file
    -> value); skips where the kernel refuses the group or the move (a container's read-only cgroup fs)."""
    group = root / f"optpipe-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:  # writable by its mode, refused by the kernel
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        for name, value in settings.items():
            (group / name).write_text(value)
        join = ("import os, sys\n"
                "try:\n    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                "except OSError as exc:\n    print('cannot join', exc); sys.exit(0)\n")
        ran = subprocess.run([sys.executable, "-c", join + code, str(group / "cgroup.procs")], capture_output=True,
                             text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        if ran.stdout.startswith("cannot join"):
            pytest.skip(ran.stdout.strip())
        return ran.stdout
    finally:
        group.rmdir()


@pytest.mark.skipif(_writable_v1("memory", "memory.limit_in_bytes") is None,
                    reason="needs a writable cgroup v1 memory hierarchy (root)")
def test_a_real_cgroups_limit_is_what_a_process_in_it_reads(tmp_path):
    """The kernel's own files, not a fake tree: a process moved into a cgroup with a 1.5 GB limit reads it."""
    out = _run_in_new_cgroup(_writable_v1("memory", "memory.limit_in_bytes"), {"memory.limit_in_bytes": str(3 * GB // 2)},
                             "from optpipe.hardware.container_limits import read_limits; print(read_limits().memory_limit)")
    assert int(out.strip()) == 3 * GB // 2


def test_a_stage_that_will_not_fit_fails_before_it_runs_and_the_other_branches_run(tmp_path, cli_run, monkeypatch):
    """A container whose memory holds the export and fp16 but not int8's estimate: int8 fails with the line naming the
    container's limit, without running; export and fp16 run and are reported, and the exit code is the input's (2)."""
    import json

    import numpy as np
    import onnx

    from helpers_passes import small_mlp
    from helpers_recipes import compile_recipe
    from optpipe.plan.source_preflight import memory_estimates
    from optpipe.safety.recipe_loading import parse_recipe

    onnx.save(small_mlp(np.random.default_rng(0)), tmp_path / "mlp.onnx")
    stages = {"export": {"pass": "export"}, "fp16": {"pass": "fp16", "after": "export"},
              "int8": {"pass": "int8", "after": "export"}}
    recipe = small_recipe({"onnx": "mlp.onnx"}, stages=stages)
    need = memory_estimates(parse_recipe(recipe, base_dir=tmp_path), tmp_path / "mlp.onnx")
    assert need["fp16"] < need["export"] < need["int8"]
    between = int((need["export"] + need["int8"]) / 2 / memory_estimate.HEADROOM)
    monkeypatch.setattr(memory_estimate, "_held_by_this_process", lambda: 0)
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(between, 0, None))
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 2, result.output
    assert "error: stage 'int8' failed: (int8) needs about" in result.output
    assert re.search(r"failed int8 \(0\.\ds\)", result.output)  # it never ran: not the time since fp16 started
    assert "is available in this container (its cgroup memory limit is" in result.output
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert stages["export"]["status"] == "ok" and stages["fp16"]["status"] == "ok"
    assert stages["int8"]["status"] == "failed" and not (tmp_path / "run" / "stages" / "int8").exists()

    # Compiled where it fits, then in the container again: the cached result is used, nothing needs to run.
    with monkeypatch.context() as roomy:
        roomy.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(None, None, None))
        assert compile_recipe(tmp_path, cli_run, recipe).exit_code == 0
    again = compile_recipe(tmp_path, cli_run, recipe)
    assert again.exit_code == 0 and "needs about" not in again.output, again.output
    assert re.search(r"cached int8", again.output)


def test_a_cpu_quota_joins_the_measurements_key_and_no_quota_leaves_it_as_it_was(monkeypatch):
    from optpipe.hardware.cpu_features import machine_id

    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(None, None, None))
    plain = machine_id()
    assert "cpu_quota" not in plain  # keys of measurements made outside a container are unchanged
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(None, None, 1.5))
    assert machine_id() == {**plain, "cpu_quota": 1.5}  # a latency throttled by the quota is not reused without it


def test_a_need_just_over_the_budget_is_not_said_as_equal_to_it(monkeypatch):
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(None, None, None))
    budget = memory_estimate.memory_budget(900_000_000)
    need = memory_estimate.stage_estimates(100 << 20, {"ov-int8": memory_estimate.OV_INT8})["ov-int8"]
    assert need > budget and f"{need / 1e9:.1f}" == f"{budget / 1e9:.1f}"  # the case met: 0.8 GB against 0.8 GB
    line = memory_estimate.over_budget(100 << 20, {"ov-int8": memory_estimate.OV_INT8}, available=900_000_000)["ov-int8"]
    assert f"needs about {need / 1e9:.2f} GB" in line and f"and {budget / 1e9:.2f} GB is available" in line


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_throttled_time_is_read_where_the_tightest_quota_is(tmp_path, version):
    """The kernel's throttled time of the cgroup whose quota binds (a parent's, here), in seconds; None without one."""
    if version == "v1":
        cpu = tmp_path / "cpu"
        _files(cpu / "kube" / "pod", cpu__cfs_quota_us="100000", cpu__cfs_period_us="100000",
               cpu__stat="nr_periods 40\nnr_throttled 30\nthrottled_time 2500000000")
        _files(cpu / "kube" / "pod" / "app", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000",
               cpu__stat="nr_periods 0\nnr_throttled 0\nthrottled_time 0")
        proc = _proc(tmp_path, "4:cpu:/kube/pod/app\n", [("/", cpu, "cgroup", "rw,cpu")])
    else:
        unified = tmp_path / "unified"
        _files(unified / "pod", cpu__max="100000 100000", cpu__stat="usage_usec 9\nthrottled_usec 2500000")
        _files(unified / "pod" / "app", cpu__max="max 100000", cpu__stat="usage_usec 9\nthrottled_usec 0")
        proc = _proc(tmp_path, "0::/pod/app\n", [("/", unified, "cgroup2", "rw")])
    assert container_limits.cpu_throttled_s(proc) == pytest.approx(2.5)
    assert container_limits.cpu_throttled_s(tmp_path / "no-proc") is None
    bare = tmp_path / "b" / "bare"
    _files(bare, cpu__max="max 100000", cpu__stat="throttled_usec 7")
    assert container_limits.cpu_throttled_s(_proc(tmp_path / "b", "0::/\n", [("/", bare, "cgroup2", "rw")])) is None


def test_the_quotas_held_back_share_flags_a_figure():
    import numpy as np

    from optpipe.evaluation.cpu_contention import CpuSnapshot, throttled_share
    from optpipe.evaluation.latency import busy_reason

    start = CpuSnapshot(wall_s=100.0, busy_s=50.0, own_s=10.0, cpus=2, throttled_s=4.0)
    # 2 s on 2 CPUs: 4 CPU-seconds offered; the quota held the threads back 1 s of them.
    assert throttled_share(start, CpuSnapshot(102.0, 53.0, 12.0, 2, throttled_s=5.0)) == 0.25
    assert throttled_share(start, CpuSnapshot(102.0, 53.0, 12.0, 2, throttled_s=None)) is None  # no quota
    assert throttled_share(start, CpuSnapshot(100.2, 53.0, 12.0, 2, throttled_s=5.0)) is None  # too short to tell
    steady = np.full(30, 5.0)
    assert busy_reason(steady, [5.0, 5.0, 5.0], throttled=0.02) is None
    assert "the container's CPU quota held it back 25%" in busy_reason(steady, [5.0, 5.0, 5.0], throttled=0.25)


@pytest.mark.skipif(_writable_v1("cpu", "cpu.cfs_quota_us") is None, reason="needs a writable cgroup v1 cpu hierarchy (root)")
def test_a_figure_timed_under_a_real_cpu_quota_says_the_quota_held_it_back(tmp_path):
    """A process in a cgroup of half a CPU times a steady computation: the kernel's throttled time marks the figure
    busy with the quota named (the host's /proc/stat sees idle CPUs meanwhile)."""
    out = _run_in_new_cgroup(_writable_v1("cpu", "cpu.cfs_quota_us"), {"cpu.cfs_quota_us": "50000"},  # 0.5 CPU a period
                             "import numpy as np\nfrom optpipe.evaluation.latency import measure\n"
                             "run = lambda feeds: {'y': sum(range(150000))}\n"
                             "lat = measure(run, {'x': np.zeros((1, 2))}, 2, 300, 1, 'cpu', adaptive=False)\n"
                             "print(lat.throttled); print(lat.unreliable)")
    throttled, unreliable = out.splitlines()[:2]
    # One thread at half a CPU waits about half of each period: a quarter of two CPUs' time.
    assert float(throttled) > 0.1, out
    assert "the container's CPU quota held it back" in unreliable


def test_a_fanned_out_compile_fails_only_the_stage_that_will_not_fit_where_it_runs(tmp_path, cli_run, monkeypatch):
    """Two recipes at once (the fan-out path searches and Ray take): the stage over this machine's memory fails
    before it runs, in its task, with the line; every other stage of both recipes runs. It was refused, whole."""
    import json

    import numpy as np
    import onnx
    import yaml

    from helpers_passes import small_mlp
    from optpipe.plan.source_preflight import memory_estimates
    from optpipe.safety.recipe_loading import parse_recipe

    onnx.save(small_mlp(np.random.default_rng(0)), tmp_path / "mlp.onnx")
    files = []
    for name, extra in (("a", {"int8": {"pass": "int8", "after": "export"}}), ("b", {})):
        stages = {"export": {"pass": "export"}, "fp16": {"pass": "fp16", "after": "export"}, **extra}
        recipe = {**small_recipe({"onnx": "mlp.onnx"}, stages=stages), "name": name, "output": f"run-{name}"}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        files.append(str(tmp_path / f"{name}.yaml"))
    need = memory_estimates(parse_recipe(yaml.safe_load(open(files[0])), base_dir=tmp_path), tmp_path / "mlp.onnx")
    between = int((need["export"] + need["int8"]) / 2 / memory_estimate.HEADROOM)
    monkeypatch.setattr(memory_estimate, "_held_by_this_process", lambda: 0)
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(between, 0, None))
    result = cli_run("compile", *files)
    assert result.exit_code == 2, result.output
    assert "(int8) needs about" in result.output and "is available in this container" in result.output
    for name, failed in (("a", {"int8"}), ("b", set())):
        stages = {s["name"]: s["status"] for s in json.loads((tmp_path / f"run-{name}" / "report.json").read_text())["stages"]}
        assert {stage for stage, status in stages.items() if status != "ok"} == failed, (name, stages)


def test_the_driver_of_a_cluster_does_not_judge_the_nodes_memory(tmp_path, monkeypatch):
    """A driver too small for even the first stage: refused at once where the stages would run on it (the local
    executor), not where they run on a cluster's nodes (Ray), whose tasks check their own memory."""
    import numpy as np
    import onnx

    from helpers_passes import small_mlp
    from optpipe.execution.executors import settings_for
    from optpipe.plan.compile_plan import CompilePlan
    from optpipe.plan.source_preflight import node_refusals
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.search.runner import _preflight

    onnx.save(small_mlp(np.random.default_rng(0)), tmp_path / "mlp.onnx")
    recipe = parse_recipe(small_recipe({"onnx": "mlp.onnx"}, stages={"export": {"pass": "export"}}), base_dir=tmp_path)
    settings = settings_for(tmp_path / "cache", tmp_path / "run", False, "auto")
    monkeypatch.setattr(memory_estimate, "_held_by_this_process", lambda: 0)
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(1 << 20, 0, None))
    with pytest.raises(UserInputError, match="stage 'export' .* needs about"):
        _preflight(recipe, settings, here=True)
    _preflight(recipe, settings, here=False)
    assert "export" in node_refusals(CompilePlan.of(recipe))  # what the node's task says, on a node this small


def test_a_node_too_small_for_the_eager_baseline_fails_its_row_before_the_model_loads(tmp_path, monkeypatch):
    """A fan-out's evaluation task on a machine whose memory cannot hold eager's evaluation (a Ray node smaller than
    the driver): the eager row fails with the memory line, the model is never built; with room, eager is measured."""
    from optpipe.execution import stage_tasks
    from optpipe.execution.executors import settings_for
    from optpipe.execution.services import RunServices
    from optpipe.plan.compile_plan import CompilePlan
    from optpipe.safety.recipe_loading import parse_recipe

    bert = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": 100}
    recipe = parse_recipe({
        "name": "tiny-bert", "model": {"hf_config": bert},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 8], "range": [0, 100]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 2}},
        "data": {"eval": {"source": "synthetic", "samples": 4, "seed": 0}},
        "stages": {"export": {"pass": "export"}},
        "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 3, "threads": 1},
    }, base_dir=tmp_path)
    plan, settings = CompilePlan.of(recipe), settings_for(tmp_path / "cache", tmp_path / "run", False, "auto")
    built = []
    original = RunServices.torch_model
    monkeypatch.setattr(RunServices, "torch_model", lambda self: built.append(1) or original(self))
    monkeypatch.setattr(memory_estimate, "_held_by_this_process", lambda: 0)
    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(1 << 20, 0, None))
    [row] = stage_tasks.evaluate(plan, [], {}, "export", True, settings)
    assert (row.name, row.status, row.error_kind) == ("pytorch-eager", "failed", "input")
    assert row.reason.startswith("PyTorch eager baseline not run here: (") and "needs about" in row.reason
    assert not built

    monkeypatch.setattr(container_limits, "read_limits", lambda proc=None: ContainerLimits(None, None, None))
    [row] = stage_tasks.evaluate(plan, [], {}, "export", True, settings)
    assert row.status == "ok" and row.latency and built
