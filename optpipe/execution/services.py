"""Run-scoped plumbing shared by the pass manager and its worker processes: the lazily built
services (torch model, data sets), the per-stage logger, and the PassContext built from them."""
from __future__ import annotations

import contextlib
import gc
import io
import logging
from functools import lru_cache
from pathlib import Path
from typing import Callable

from optpipe.cache.store import StageCache
from optpipe.calibration.dataset import SampleSet, build_sample_set, require_finite_calibration
from optpipe.core.errors import DataError
from optpipe.source.model_source import load_torch_model
from optpipe.source.torch_weights import RELEASE_BYTES
from optpipe.pass_infra.pass_base import PassContext
from optpipe.plan.compile_plan import CompilePlan
from optpipe.recipe.schema import DataSets, ModelSource


class RunServices:
    """Lazy, run-scoped things passes share: the torch model and the data sets, each built once.
    It takes the recipe's model source and data sets, nothing else of it."""

    def __init__(self, source: ModelSource, data: DataSets, cache: StageCache):
        self.source = source
        self.data = data
        self.cache = cache

    @lru_cache(maxsize=1)
    def torch_model(self):
        return load_torch_model(self.source)

    def release_torch_model(self, always: bool = False) -> bool:
        """Drop the loaded torch model when it is big (>= RELEASE_BYTES of FP32 weights), so that the
        passes after the export do not run beside it; the eager evaluation loads it again (the same
        seeded weights for hf_config, the same files for hf). Sources whose size is unknown (factories,
        torchvision: not seeded, a reload could differ) are kept. Measured through compile (bench/llm.py
        --compile, 0.37 B): it stayed resident, 1x the FP32 weights, under every weight-only pass. True
        when dropped. `always`: whatever its size or source (eager timed apart: what is loaded again is
        only timed, its outputs are not compared)."""
        from optpipe.source.torch_weights import fp32_weight_bytes

        if self.torch_model.cache_info().currsize == 0:
            return False
        if not always and (fp32_weight_bytes(self.source) or 0) < RELEASE_BYTES:
            return False
        self.torch_model.cache_clear()
        gc.collect()  # a module's parameters can sit in reference cycles: free them before the next pass peaks
        return True

    @lru_cache(maxsize=1)
    def eval_set(self) -> SampleSet:
        return build_sample_set(self.data.eval, self.source, self.cache)

    @lru_cache(maxsize=1)
    def calibration_set(self) -> SampleSet:
        source = self.data.calibration
        if source is None:
            raise DataError("data.calibration: this stage needs a calibration set; add `data: {calibration: ...}` to the recipe")
        return require_finite_calibration(build_sample_set(source, self.source, self.cache))

    def data_set(self, which: str) -> SampleSet:
        """A set by the name PassContext records it under ("eval", "calibration")."""
        return {"eval": self.eval_set, "calibration": self.calibration_set}[which]()


def make_pass_context(
    plan: CompilePlan,
    services: RunServices,
    stage: str,
    workdir: Path,
    log: logging.Logger,
    progress: Callable[[str, int, int], None] | None = None,
) -> PassContext:
    """The context one stage's pass runs with, in this process or in a worker: the plan's typed
    parts a pass reads, never the plan or the recipe itself."""
    extra = {"progress": progress} if progress else {}
    return PassContext(
        model_source=services.source,
        evaluate=plan.evaluate,
        target_kinds=plan.target_kinds(),
        stage=stage,
        workdir=workdir,
        log=log,
        cache_dir=services.cache.root,
        torch_model=services.torch_model,
        eval_set=services.eval_set,
        calibration_set=services.calibration_set,
        tolerance=plan.stages[stage].tolerance,
        **extra,
    )


@contextlib.contextmanager
def stage_logger(name: str, path: Path, truncate: bool = True):
    """A logger writing to the stage's log file (and Python warnings with it) while the stage runs.

    Appending (after truncating once): a stage's worker process writes to the same file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if truncate:
        path.write_text("", encoding="utf-8")
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger(f"optpipe.stage.{name}")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(handler)
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield log
    finally:
        logging.captureWarnings(False)
        warnings_log.removeHandler(handler)
        log.removeHandler(handler)
        with contextlib.suppress(OSError):  # a full disk: the error that stopped the stage matters more than the log's tail
            handler.close()


class LogWriter(io.TextIOBase):
    """A file-like object sending what libraries print into the stage log instead of the terminal. A text stream
    in full (io.TextIOBase: isatty, closed, ...): transformers' loading report asks sys.stdout.isatty() when a
    checkpoint has keys the model does not use (a classifier's head loaded as AutoModel), and a plain object
    failed that export with "'LogWriter' object has no attribute 'isatty'"."""

    def __init__(self, log: logging.Logger):
        super().__init__()
        self.log = log

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text.strip():
            self.log.info("%s", text.rstrip())
        return len(text)

    def flush(self) -> None:
        pass
