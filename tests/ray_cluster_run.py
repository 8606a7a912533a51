"""Run inside a loopback-only network and PID namespace (see tests/test_ray_executor.py):
start a Ray cluster of a head and two worker nodes on 127.0.0.1, run `optpipe compile --executor ray` on it and kill
that driver after a few stages; rerun it, kill one worker node once it has finished some work
while the run goes on, and let the run finish. Then a worker with a logical GPU of type
`testgpu` joins and a plain recipe with targets runs with `--only` (the targets' scheduling).

Ray's daemons advertise the machine's interface address even when told 127.0.0.1; in this
namespace only loopback exists, so nothing leaves it. The namespace's PID 1 is this script:
when it ends, the kernel kills every process left in the namespace (the cluster included).

Prints one JSON line: the driver's exit code, its progress lines, when the worker was killed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

PORT = 6390
# Ray's and optpipe's command lines through this interpreter: no PATH lookup.
RAY = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]
OPTPIPE = [sys.executable, "-m", "optpipe.cli"]


def sh(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120, **kw)


def main(recipe: str, run_dir: str, cache: str, kill_driver_after: int, kill_worker_after: int, allow: str,
         targets_recipe: str | None = None, targets_run: str | None = None) -> dict:
    sh("ip", "link", "set", "lo", "up")
    # No token auth: a ~/.ray/auth_token left by any local `ray.init()` would otherwise switch it on
    # for `ray start` but not for every client of this cluster.
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # this process's ray.init too
    # The head runs no tasks (0 CPUs): two worker nodes share the work, and one of them is killed.
    # With the head working too, Ray's hybrid scheduler kept the tasks on the driver's node (the
    # head) until half its CPUs were busy, and in about one run of four the worker got a single
    # task and was never killed. A spread threshold of 0 sends each task to the least busy node.
    env = dict(os.environ, RAY_scheduler_spread_threshold="0")
    sh(*RAY, "start", "--head", f"--port={PORT}", "--node-ip-address=127.0.0.1", "--num-cpus=0", "--include-dashboard=false",
       "--disable-usage-stats", env=env)
    worker = _start_worker({"benchmark": 1, "worker_node": 1}, env)
    worker_id = _wait_for_worker()
    _start_worker({"benchmark": 1, "survivor_node": 1}, env)  # one at a time: two at once may not both join
    _wait_for_worker("survivor_node")
    compile_cmd = [*OPTPIPE, "compile", recipe, "--executor", "ray", "--address", f"127.0.0.1:{PORT}", "-o", run_dir, "--cache-dir", cache,
                   "--allow-path", allow]

    # 1. The driver killed after a few stages: what it finished is in the cache.
    first = subprocess.Popen(compile_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_lines = []
    for line in first.stdout:
        first_lines.append(line.rstrip())
        if sum(" ok pass " in x for x in first_lines) >= kill_driver_after:
            first.kill()
            break
    first.wait(timeout=60)

    # 2. A rerun, with the worker node killed once it has finished some work.
    driver = subprocess.Popen(compile_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, killed_at, worker_lines = [], None, 0
    for line in driver.stdout:
        lines.append(line.rstrip())
        if worker_id[:12] in line:
            worker_lines += 1
        if killed_at is None and worker_lines >= kill_worker_after:
            os.killpg(worker.pid, signal.SIGKILL)  # the node's raylet, its workers and their running tasks
            killed_at = len(lines)
    code = driver.wait(timeout=600)
    result = {"returncode": code, "lines": lines, "killed_at": killed_at, "worker": worker_id[:12],
              "first_lines": first_lines, "first_returncode": first.returncode}
    if targets_recipe:
        result.update(_targets_on_a_gpu_node(targets_recipe, targets_run, cache, allow, env))
    return result


def _targets_on_a_gpu_node(recipe: str, run_dir: str, cache: str, allow: str, env: dict) -> dict:
    """3. A worker node with a (logical) GPU of type `testgpu` joins; `--only` compiles a plain
    recipe whose targets ask for that GPU type, for a type no node has, and for no GPU."""
    _start_worker({"benchmark": 1, "gpu:testgpu": 1}, env, "--num-gpus=1")
    gpu_node = _wait_for_worker("gpu:testgpu")
    proc = subprocess.run([*OPTPIPE, "compile", recipe, "--executor", "ray", "--address", f"127.0.0.1:{PORT}", "-o", run_dir,
                           "--cache-dir", cache, "--allow-path", allow, "--only", "prune"],
                          env=env, capture_output=True, text=True, timeout=300)
    return {"targets_returncode": proc.returncode, "targets_lines": (proc.stdout + proc.stderr).splitlines(), "gpu_node": gpu_node[:12]}


def _start_worker(resources: dict, env: dict, *flags: str) -> subprocess.Popen:
    """A worker node with 2 CPUs in a session of its own (killing its group kills the node)."""
    return subprocess.Popen(
        [*RAY, "start", f"--address=127.0.0.1:{PORT}", f"--resources={json.dumps(resources)}", *flags, "--block",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _wait_for_worker(resource: str = "worker_node") -> str:
    import ray

    ray.init(address=f"127.0.0.1:{PORT}", log_to_driver=False)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]
            if nodes:
                return nodes[0]["NodeID"]
            time.sleep(0.5)
        raise RuntimeError("the worker node did not join within 90 s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], *sys.argv[7:9])
    print(json.dumps(result))
