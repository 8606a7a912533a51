"""The built engine's accuracy against the reference and its latency, through Polygraphy's TrtRunner."""
from __future__ import annotations

from pathlib import Path

from optpipe.core.runtime import join_batches
from optpipe.evaluation.accuracy import quiet_polygraphy
from optpipe.targets.base import TargetJob


def evaluate_engine(plan_path: Path, job: TargetJob, provider: str):
    """Accuracy against the reference through Polygraphy's TrtRunner, and latency percentiles."""
    from polygraphy.backend.trt import EngineFromPath, TrtRunner
    from polygraphy.comparator import Comparator

    quiet_polygraphy()
    measurer = job.measurer
    engine = EngineFromPath(str(plan_path))
    results = Comparator.run([TrtRunner(engine, name="tensorrt")], data_loader=measurer.batches)
    outputs = join_batches(list(results[0][1]))
    accuracy = measurer.accuracy(outputs, job.settings.tolerance_for(job.stage.name))
    with TrtRunner(engine, name="tensorrt-latency") as runner:
        latency = measurer.latency(lambda feeds: runner.infer(feeds), provider)
    return accuracy, latency
