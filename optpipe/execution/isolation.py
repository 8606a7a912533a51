"""Run one pass in a worker process, so that a time limit can stop it and an out-of-memory
kill takes down the stage, not the run.

Used for stages with `timeout_s`. A watchdog thread cannot stop a pass stuck in
C++ (onnxsim, an exporter, ORT), and a signal only reaches Python code between
bytecodes; a process can always be killed. The worker rebuilds the run's
services from the recipe (the torch model, the cached sample sets), writes the
pass's output into the same private workdir, and reports back through a small
JSON file; the parent publishes the workdir as usual. The limit counts from the
moment the worker has started (imports done), not from its spawn.

    python -m optpipe.execution.isolation REQUEST.json
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from optpipe.artifact import ModelArtifact
from optpipe.errors import OptpipeError, PassError, StageOutOfMemory, StageTimeout, first_line
from optpipe.pass_base import Pass
from optpipe.recipe import Recipe

POLL_S = 0.1
GRACE_S = 2.0  # between SIGTERM and SIGKILL when stopping a worker


def run_pass_isolated(
    recipe: Recipe,
    stage: str,
    pass_: Pass,
    model: ModelArtifact | None,
    workdir: Path,
    cache_root: Path,
    log_path: Path,
    timeout_s: float,
) -> None:
    """Run `pass_` in a worker; returns when its output is in `workdir`, else raises what went wrong."""
    files = _WorkerFiles(workdir)
    files.request.write_text(json.dumps({
        "recipe": recipe.model_dump(mode="json", by_alias=True, exclude={"base_dir"}),
        "base_dir": str(recipe.base_dir),
        "stage": stage,
        "pass": pass_.name,
        "params": pass_.params.model_dump(mode="json"),
        "input": str(model.folder) if model else None,
        "workdir": str(workdir),
        "cache": str(cache_root),
        "log": str(log_path),
        "started": str(files.started),
        "result": str(files.result),
    }))
    try:
        with open(log_path, "a", encoding="utf-8") as log_file:
            worker = subprocess.Popen(
                [sys.executable, "-m", "optpipe.execution.isolation", str(files.request)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            )
        try:
            returncode = _wait(worker, files.started, timeout_s, stage)
        except BaseException:  # the time limit, Ctrl-C: the worker must not outlive the stage
            _stop(worker)
            raise
        _raise_failure(stage, pass_.name, files.read_result(), returncode)
    finally:
        files.remove()


class _WorkerFiles:
    """The request, the 'started' marker and the result, beside the workdir (never inside it)."""

    def __init__(self, workdir: Path):
        self.request = workdir.with_name(workdir.name + ".request.json")
        self.started = workdir.with_name(workdir.name + ".started")
        self.result = workdir.with_name(workdir.name + ".result.json")

    def read_result(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.result.read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for path in (self.request, self.started, self.result):
            path.unlink(missing_ok=True)


def _wait(worker: subprocess.Popen, started: Path, timeout_s: float, stage: str) -> int:
    deadline = None
    while True:
        try:
            return worker.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if deadline is None and started.exists():
            deadline = time.monotonic() + timeout_s
        if deadline is not None and time.monotonic() > deadline:
            raise StageTimeout(stage, timeout_s)


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def _raise_failure(stage: str, pass_name: str, result: dict[str, Any] | None, returncode: int) -> None:
    if result is None:
        if returncode < 0 and -returncode == signal.SIGKILL:
            raise StageOutOfMemory(
                "its worker process was killed (SIGKILL), most likely by the system running out of memory; "
                "free memory or run it on a machine with more"
            )
        how = f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
        raise PassError(f"its worker process ended with {how} before reporting a result")
    status, message = result["status"], result.get("message", "")
    if status == "ok":
        return
    if status == "pass":
        raise PassError(message)
    if status == "user":
        raise OptpipeError(message)
    if status == "memory":
        raise StageOutOfMemory(message)
    raise PassError(f"internal error in pass '{pass_name}' ({message})")


# --- the worker side -----------------------------------------------------------------------


def worker_main(request_path: Path) -> int:
    request = json.loads(request_path.read_text())
    result_path = Path(request["result"])
    try:
        outcome = _run_request(request)
    except KeyboardInterrupt:
        return 130
    _write_result(result_path, outcome)
    return 0


def _run_request(request: dict[str, Any]) -> dict[str, str]:
    from optpipe.cache.store import StageCache
    from optpipe.passes import get_pass
    from optpipe.pipeline import PassManager, RunOptions, RunServices, _LogWriter, stage_logger
    from optpipe.recipe import parse_recipe

    stage = request["stage"]
    with stage_logger(stage, Path(request["log"]), truncate=False) as log:
        try:
            recipe = parse_recipe(request["recipe"], base_dir=Path(request["base_dir"]))
            cache = StageCache(Path(request["cache"]))
            cls = get_pass(request["pass"])
            pass_ = cls(cls.Params.model_validate(request["params"]))
            model = ModelArtifact.open(Path(request["input"])) if request["input"] else None
            services = RunServices(recipe, cache)
            manager = PassManager(recipe, cache, services, Path(request["log"]).parent.parent, RunOptions())
            ctx = manager._context(stage, Path(request["workdir"]), log)
            Path(request["started"]).touch()
            with contextlib.redirect_stdout(_LogWriter(log)):
                pass_.run(model, ctx)
            return {"status": "ok"}
        except PassError as exc:
            return {"status": "pass", "message": str(exc)}
        except OptpipeError as exc:
            return {"status": "user", "message": str(exc)}
        except MemoryError as exc:
            log.error("out of memory:\n%s", traceback.format_exc())
            return {"status": "memory", "message": memory_message(exc)}
        except Exception as exc:  # a bug in a pass: the log has the traceback
            log.error("unexpected error:\n%s", traceback.format_exc())
            return {"status": "internal", "message": f"{type(exc).__name__}: {first_line(exc)}"}


def memory_message(exc: MemoryError) -> str:
    detail = f" ({first_line(exc)})" if str(exc) else ""
    return f"ran out of memory{detail}; free memory, use a machine with more, or lower the pass's sizes"


def _write_result(path: Path, outcome: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(worker_main(Path(sys.argv[1])))
