"""One stage, cached: its key, a cache hit, or a run of its pass under the contract, published.

The key hashes the input model, the pass (name, version, params, libraries, its own
fingerprint) and the keys of the data sets the pass read. Which sets a pass reads is
learnt from its last run with the same inputs (recorded in the cache as a small
result, like a compiler's dependency file), so a pass author never declares it.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from optpipe.artifact import ModelArtifact
from optpipe.cache.store import StageCache, library_versions
from optpipe.errors import OptpipeError, PassError, StageOutOfMemory, first_line
from optpipe.execution.contract import run_pass
from optpipe.execution.interrupt import InterruptWatch, escalate
from optpipe.execution.isolation import memory_message, run_pass_isolated
from optpipe.execution.services import RunServices, make_pass_context, stage_logger
from optpipe.pass_base import Pass, PassContext
from optpipe.recipe import Recipe

KEY_FORMAT = 2


@dataclass
class StageOutcome:
    status: str  # ok | failed | skipped
    artifact: ModelArtifact | None = None
    cached: bool = False
    reason: str | None = None
    duration_s: float = 0.0
    key: str | None = None


class StageRunner:
    """Runs one stage at a time; a stage's failure is returned as an outcome, never raised."""

    def __init__(self, recipe: Recipe, cache: StageCache, services: RunServices, logs_dir: Path, force: bool = False,
                 progress: Callable[[str, int, int], None] | None = None):
        self.recipe = recipe
        self.cache = cache
        self.services = services
        self.logs_dir = logs_dir
        self.force = force
        self.progress = progress

    def run(self, name: str, pass_: Pass, model: ModelArtifact | None) -> StageOutcome:
        log_path = self.logs_dir / f"{name}.log"
        started = time.perf_counter()

        def failed(reason: str) -> StageOutcome:
            return StageOutcome("failed", reason=f"{reason} (log: {log_path})", duration_s=time.perf_counter() - started)

        with stage_logger(name, log_path) as log:
            workdir = self.cache.new_workdir()
            watch = InterruptWatch()
            try:
                ctx = make_pass_context(self.recipe, self.services, name, workdir, log, self.progress)
                artifact, key, cached = self._cached_run(pass_, model, ctx, log_path, watch)
                return StageOutcome("ok", artifact, cached=cached, key=key, duration_s=time.perf_counter() - started)
            except (PassError, OptpipeError) as exc:
                escalate(exc, self.cache.root, watch)  # a Ctrl-C or a full disk behind it stops the run, not only this stage
                log.error("%s", exc)
                return failed(str(exc))
            except MemoryError as exc:
                log.error("out of memory:\n%s", traceback.format_exc())
                return failed(str(StageOutOfMemory(memory_message(exc))))
            except Exception as exc:  # a bug in a pass must not take the other branches down
                escalate(exc, self.cache.root, watch)
                log.error("unexpected error:\n%s", traceback.format_exc())
                return failed(f"internal error in pass '{pass_.name}' ({type(exc).__name__}: {first_line(exc)})")
            finally:
                self.cache.release_workdir(workdir)

    def _cached_run(self, pass_: Pass, model: ModelArtifact | None, ctx: PassContext, log_path: Path,
                    watch: InterruptWatch) -> tuple[ModelArtifact, str, bool]:
        """(artifact, key, cached): the cache entry when there is one, else the pass's fresh output, published."""
        base = stage_key(pass_, model, ctx)
        with self.cache.lock(base):
            read_before = self._data_read_last_time(base)
            key = self._key_with_data(base, read_before)
            hit = None if self.force else self.cache.lookup(key)
            if hit is not None:
                ctx.log.info("cache hit %s", key)
                return hit, key, True
            ctx.log.info("running pass %s v%s with %s", pass_.name, pass_.version, pass_.params.model_dump())
            self._execute(pass_, model, ctx, log_path)
            watch.check()  # a Ctrl-C the pass swallowed: its result is not published
            key = self._key_with_data(base, ctx.data_used)
            if set(ctx.data_used) != set(read_before):  # most passes read no data set: no record at all
                self.cache.put_result(_data_record_key(base), {"sets": sorted(ctx.data_used)})
            if self.force:
                self.cache.discard(self.cache.entry_dir(key))
            meta = {"stage": ctx.stage, "pass": pass_.name, "recipe": self.recipe.name}
            return self.cache.publish(key, ctx.workdir, meta), key, False

    def _execute(self, pass_: Pass, model: ModelArtifact | None, ctx: PassContext, log_path: Path) -> ModelArtifact:
        """In this process, or in a worker process when the stage has a time limit."""
        timeout_s = self.recipe.stages[ctx.stage].timeout_s
        if timeout_s is None:
            return run_pass(pass_, model, ctx)
        return run_pass_isolated(pass_, model, ctx, log_path, timeout_s)

    def _data_read_last_time(self, base: str) -> dict[str, str]:
        record = self.cache.get_result(_data_record_key(base))
        return {which: self.services.data_set(which).key for which in (record or {}).get("sets", [])}

    @staticmethod
    def _key_with_data(base: str, data: dict[str, str]) -> str:
        return StageCache.key(stage=base, data=data) if data else base


def stage_key(pass_: Pass, model: ModelArtifact | None, ctx: PassContext) -> str:
    """The key of everything a stage's output depends on, except the data sets its pass reads."""
    return StageCache.key(
        format=KEY_FORMAT,
        input=model.content_hash() if model else None,
        pass_name=pass_.name,
        version=pass_.version,
        params=pass_.params.model_dump(mode="json"),
        extra=pass_.fingerprint(ctx),
        libraries=library_versions(pass_.libraries),
    )


def _data_record_key(base: str) -> str:
    return StageCache.key(data_sets_read_by=base)

