"""Run one pass in a worker process, so that a time limit can stop it and an out-of-memory
kill takes down the stage, not the run.

Used for stages with `timeout_s`. A watchdog thread cannot stop a pass stuck in
C++ (onnxsim, an exporter, ORT), and a signal only reaches Python code between
bytecodes; a process can always be killed. The worker rebuilds the run's
services from the compile's plan (the torch model, the cached sample sets), runs the pass
under the same contract (optpipe/execution/contract.py) into the same private
workdir, and reports back through a small JSON file (status, the returned
artifact's info, the data sets it read); the parent publishes the workdir as usual. The
pass's progress steps come back through another small file, which the parent reads as it
polls and hands to its console: a worker's stage shows its steps as an in-process one does. The limit counts from the
moment the worker has started (imports done), not from its spawn.

    python -m optpipe.execution.isolation REQUEST.json
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optpipe.core.artifact import ModelArtifact
from optpipe.core.errors import OptpipeError, PassCrashed, PassError, StageOutOfMemory, StageTimeout, UserInputError, first_line
from optpipe.pass_infra.pass_base import Pass, PassContext

if TYPE_CHECKING:
    from optpipe.plan.compile_plan import CompilePlan

POLL_S = 0.1
GRACE_S = 2.0  # between SIGTERM and SIGKILL when stopping a worker
PROGRESS_S = 0.1  # the worker writes its progress file at most this often


def run_pass_isolated(pass_: Pass, model: ModelArtifact | None, ctx: PassContext, plan: "CompilePlan", log_path: Path,
                      timeout_s: float) -> ModelArtifact:
    """Run `pass_` in a worker; returns the artifact it made in `ctx.workdir`, else raises what went wrong.

    The data sets the worker's pass read are added to `ctx.data_used`, as if it had run here.
    """
    stage, workdir = ctx.stage, ctx.workdir
    files = _WorkerFiles(workdir)
    files.request.write_text(json.dumps({
        "plan": plan.to_document(),
        "stage": stage,
        "pass": pass_.name,
        "params": pass_.params.model_dump(mode="json"),
        "input": str(model.folder) if model else None,
        "workdir": str(workdir),
        "cache": str(ctx.cache_dir),
        "log": str(log_path),
        "started": str(files.started),
        "result": str(files.result),
        "progress": str(files.progress),
    }))
    try:
        with open(log_path, "a", encoding="utf-8") as log_file:
            worker = subprocess.Popen(
                [sys.executable, "-m", "optpipe.execution.isolation", str(files.request)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            )
        try:
            returncode = _wait(worker, files, timeout_s, stage, ctx.progress)
        except BaseException:  # the time limit, Ctrl-C: the worker must not outlive the stage
            _stop(worker)
            raise
        result = files.read_result()
        _raise_failure(stage, pass_.name, result, returncode)
        ctx.data_used.update(result["data_used"])
        return ModelArtifact(folder=workdir, info=result["info"])
    finally:
        files.remove()


class _WorkerFiles:
    """The request, the 'started' marker and the result, beside the workdir (never inside it)."""

    def __init__(self, workdir: Path):
        self.request = workdir.with_name(workdir.name + ".request.json")
        self.started = workdir.with_name(workdir.name + ".started")
        self.result = workdir.with_name(workdir.name + ".result.json")
        self.progress = workdir.with_name(workdir.name + ".progress.json")
        self._step: list | None = None

    def forward_progress(self, progress) -> None:
        """The worker's latest step, once, to the parent's progress (a torn or missing file: none yet)."""
        try:
            step = json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return
        if isinstance(step, list) and len(step) == 3 and step != self._step:
            self._step = step
            progress(str(step[0]), int(step[1]), int(step[2]))

    def read_result(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.result.read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for path in (self.request, self.started, self.result, self.progress):
            path.unlink(missing_ok=True)


def _wait(worker: subprocess.Popen, files: _WorkerFiles, timeout_s: float, stage: str, progress) -> int:
    deadline = None
    while True:
        try:
            return worker.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        files.forward_progress(progress)
        if deadline is None and files.started.exists():
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
    if status == "input":  # the user's model or data: the kind must survive the process boundary
        raise UserInputError(message)
    if status == "user":
        raise OptpipeError(message)
    if status == "memory":
        raise StageOutOfMemory(message)
    raise PassCrashed(f"internal error in pass '{pass_name}' ({message})")


# --- the worker side -----------------------------------------------------------------------


def worker_main(request_path: Path) -> int:
    request = json.loads(request_path.read_text())
    result_path = Path(request["result"])
    try:
        outcome = _run_request(request)
    except KeyboardInterrupt:
        return 130
    _write_json(result_path, outcome)
    return 0


def _run_request(request: dict[str, Any]) -> dict[str, Any]:
    from optpipe.cache.store import StageCache
    from optpipe.execution.contract import run_pass
    from optpipe.execution.services import RunServices, make_pass_context, stage_logger
    from optpipe.passes import get_pass
    from optpipe.plan.compile_plan import CompilePlan

    stage = request["stage"]
    with stage_logger(stage, Path(request["log"]), truncate=False) as log:
        try:
            plan = CompilePlan.from_document(request["plan"])
            cache = StageCache(Path(request["cache"]))
            cls = get_pass(request["pass"])
            pass_ = cls(cls.Params.model_validate(request["params"]))
            model = ModelArtifact.open(Path(request["input"])) if request["input"] else None
            progress = _progress_file(Path(request["progress"])) if request.get("progress") else None
            ctx = make_pass_context(plan, RunServices(plan.model_source(), plan.data, cache), stage, Path(request["workdir"]), log,
                                    progress)
            Path(request["started"]).touch()
            artifact = run_pass(pass_, model, ctx)
            return {"status": "ok", "info": artifact.info, "data_used": ctx.data_used}
        except PassError as exc:
            return {"status": "pass", "message": str(exc)}
        except UserInputError as exc:
            return {"status": "input", "message": str(exc)}
        except OptpipeError as exc:
            return {"status": "user", "message": str(exc)}
        except MemoryError as exc:
            log.error("out of memory:\n%s", traceback.format_exc())
            return {"status": "memory", "message": memory_message(exc)}
        except Exception as exc:  # a bug in a pass: the log has the traceback
            log.error("unexpected error:\n%s", traceback.format_exc())
            return {"status": "internal", "message": f"{type(exc).__name__}: {first_line(exc)}"}


def _progress_file(path: Path):
    """The worker's progress: its latest step in a file the parent polls (every POLL_S), written at
    most every PROGRESS_S (a pass may report thousands of steps) and always when the task changes."""
    last = {"at": 0.0, "task": None}

    def report(task: str, done: int, total: int) -> None:
        now = time.monotonic()
        if task == last["task"] and now - last["at"] < PROGRESS_S:
            return
        last.update(at=now, task=task)
        try:
            _write_json(path, [task, done, total])
        except OSError:  # progress is a nicety: a full disk must not fail the pass
            pass

    return report


def memory_message(exc: MemoryError) -> str:
    detail = f" ({first_line(exc)})" if str(exc) else ""
    return f"ran out of memory{detail}; free memory, use a machine with more, or lower the pass's sizes"


def _write_json(path: Path, outcome: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(outcome, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(worker_main(Path(sys.argv[1])))
