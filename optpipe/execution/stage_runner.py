"""One stage, cached: its key, a cache hit, or a run of its pass under the contract, published.

The key hashes the input model, the pass (name, version, params, libraries, its own
fingerprint) and the keys of the data sets the pass read. Which sets a pass reads is
learnt from its last run with the same inputs (recorded in the cache as a small
result, like a compiler's dependency file), so a pass author never declares it.
"""
from __future__ import annotations

import math
import time
import traceback
from pathlib import Path
from typing import Callable

from optpipe.core.artifact import ModelArtifact, write_info
from optpipe.cache.store import StageCache, library_versions
from optpipe.core.errors import OptpipeError, PassError, StageOutOfMemory, UserInputError, first_line
from optpipe.hardware.cpu_features import engine_target
from optpipe.evaluation.self_check import NumericSelfCheck, self_check_fingerprint
from optpipe.execution.contract import run_pass
from optpipe.execution.interrupt import InterruptWatch, escalate
from optpipe.execution.isolation import memory_message, run_pass_isolated
from optpipe.execution.services import RunServices, make_pass_context, stage_logger
from optpipe.pass_infra.instruments import Instrument, Instruments, StageInfo
from optpipe.pass_infra.pass_base import Pass, PassContext
from optpipe.plan.compile_plan import CompilePlan
from optpipe.core.results import ErrorKind, StageResult, error_kind
from optpipe.core.signal_stack import restore_signal_stack

KEY_FORMAT = 2
DATA_SETS = ("eval", "calibration")  # the names RunServices.data_set knows


class StageRunner:
    """Runs one stage at a time; a stage's failure is returned as its result, never raised."""

    def __init__(self, plan: CompilePlan, cache: StageCache, services: RunServices, logs_dir: Path, instruments: Instrument,
                 force: bool = False, too_big: dict[str, str] | Callable[[], dict[str, str]] | None = None):
        """`too_big`: stages the memory preflight says will not fit, with why (or how to find them, asked on a cache
        miss only): a cache hit is used, else they fail without running (the user's input, exit 2) and the other
        branches run."""
        self.plan = plan
        self.too_big = too_big or {}
        self.cache = cache
        self.services = services
        self.logs_dir = logs_dir
        # The numeric self-check always runs first after a pass: a stage it fails is never published.
        self.instruments = Instruments([NumericSelfCheck(), instruments])
        self.force = force

    def run(self, name: str, pass_: Pass, model: ModelArtifact | None) -> StageResult:
        restore_signal_stack()  # a native library may have left it dangling: Ctrl-C must not crash
        log_path = self.logs_dir / f"{name}.log"
        started = time.perf_counter()
        spec = self.plan.stages[name]

        def result(status: str, reason: str | None = None, cached: bool = False) -> StageResult:
            return StageResult(name=name, pass_name=spec.pass_name, parent=spec.parent, status=status, cached=cached,
                               reason=reason, duration_s=round(time.perf_counter() - started, 3))

        def failed(reason: str, kind: ErrorKind = "stage") -> StageResult:
            # The user's input is named by its message alone; a pass's failure points at its log.
            failure = result("failed", reason if kind == "input" else f"{reason} (log: {log_path})")
            failure.error_kind = kind
            return failure

        with stage_logger(name, log_path) as log:
            workdir = self.cache.new_workdir()
            watch = InterruptWatch()
            try:
                ctx = make_pass_context(self.plan, self.services, name, workdir, log, self.instruments.step)
                info = StageInfo(name, pass_, ctx)
                self.instruments.before_stage(info)
                skip = pass_.skip_reason(ctx)
                if skip:
                    log.info("not run: %s", skip)
                    return result("skipped", skip).model_copy(update={"not_run": True})
                artifact, cached = self._cached_run(info, model, log_path, watch)
                return result("ok", cached=cached).with_model(artifact)
            except (PassError, OptpipeError) as exc:
                escalate(exc, self.cache.root, watch)  # a Ctrl-C or a full disk behind it stops the run, not only this stage
                log.error("%s", exc)
                return failed(str(exc), error_kind(exc))
            except MemoryError as exc:
                log.error("out of memory:\n%s", traceback.format_exc())
                return failed(str(StageOutOfMemory(memory_message(exc))))
            except Exception as exc:  # a bug in a pass must not take the other branches down
                escalate(exc, self.cache.root, watch)
                log.error("unexpected error:\n%s", traceback.format_exc())
                return failed(f"internal error in pass '{pass_.name}' ({type(exc).__name__}: {first_line(exc)})", "internal")
            finally:
                self.cache.release_workdir(workdir)

    def _cached_run(self, info: StageInfo, model: ModelArtifact | None, log_path: Path,
                    watch: InterruptWatch) -> tuple[ModelArtifact, bool]:
        """(artifact, cached): the cache entry when there is one, else the pass's fresh output, published."""
        pass_, ctx = info.pass_, info.ctx
        base = stage_key(pass_, model, ctx)
        with self.cache.lock(base):
            read_before = self._data_read_last_time(base)
            key = self._key_with_data(base, read_before)
            hit = None if self.force else self.cache.lookup(key)
            if hit is not None:
                ctx.log.info("cache hit %s", key)
                return hit, True
            too_big = self.too_big() if callable(self.too_big) else self.too_big
            if ctx.stage in too_big:
                raise UserInputError(too_big[ctx.stage])
            ctx.log.info("running pass %s v%s with %s", pass_.name, pass_.version, pass_.params.model_dump())
            output = self._execute(pass_, model, ctx, log_path)
            watch.check()  # a Ctrl-C the pass swallowed: its result is not published
            self.instruments.after_stage(info, model, output)  # the self-check; may fail the stage
            write_info(ctx.workdir, output.info)  # with what the instruments added
            key = self._key_with_data(base, ctx.data_used)
            if set(ctx.data_used) != set(read_before):  # most passes read no data set: no record at all
                self.cache.put_result(_data_record_key(base), {"sets": sorted(ctx.data_used)})
            if self.force:
                self.cache.discard(self.cache.entry_dir(key))
            meta = {"stage": ctx.stage, "pass": pass_.name, "recipe": self.plan.name}
            return self.cache.publish(key, ctx.workdir, meta), False

    def _execute(self, pass_: Pass, model: ModelArtifact | None, ctx: PassContext, log_path: Path) -> ModelArtifact:
        """In this process, or in a worker process when the stage has a time limit or its pass asks for one."""
        timeout_s = self.plan.stages[ctx.stage].timeout_s
        apart = pass_.own_process(ctx)
        if timeout_s is None and apart is None:
            return run_pass(pass_, model, ctx)
        if apart is not None:
            ctx.log.info("in a worker process of its own: %s", apart)
        output = run_pass_isolated(pass_, model, ctx, self.plan, log_path, math.inf if timeout_s is None else timeout_s)
        if apart is not None:
            output.info["own_process"] = apart
        return output

    def _data_read_last_time(self, base: str) -> dict[str, str]:
        record = self.cache.get_result(_data_record_key(base))
        sets = (record or {}).get("sets", [])
        # A record is cache data, untrusted like any entry (a shared cache anyone may write):
        # names that are not data sets mean no usable record, so the pass runs and rewrites it.
        if not isinstance(sets, list) or not all(which in DATA_SETS for which in sets):
            return {}
        return {which: self.services.data_set(which).key for which in sets}

    @staticmethod
    def _key_with_data(base: str, data: dict[str, str]) -> str:
        return StageCache.key(stage=base, data=data) if data else base


def run_checked(pass_: Pass, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
    """One pass as a stage runs it, without the cache: the contract, then the numeric self-check
    (its record in the returned info). For tests and notebooks."""
    output = run_pass(pass_, model, ctx)
    NumericSelfCheck().after_stage(StageInfo(ctx.stage, pass_, ctx), model, output)
    return write_info(ctx.workdir, output.info)


def stage_key(pass_: Pass, model: ModelArtifact | None, ctx: PassContext) -> str:
    """The key of everything a stage's output depends on, except the data sets its pass reads."""
    # The CPU class only where the pass declares its output depends on it: other keys stay as they were.
    cpu = {"cpu": engine_target(pass_.isa_engine).key()} if pass_.isa_dependent else {}
    return StageCache.key(
        **cpu,
        format=KEY_FORMAT,
        input=model.content_hash() if model else None,
        pass_name=pass_.name,
        version=pass_.version,
        params=pass_.params.model_dump(mode="json"),
        extra=pass_.fingerprint(ctx),
        self_check=self_check_fingerprint(pass_.params, ctx.inputs),
        libraries=library_versions(pass_.libraries),
    )


def _data_record_key(base: str) -> str:
    return StageCache.key(data_sets_read_by=base)

