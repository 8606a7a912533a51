"""Recipe values that turn into threads or memory, bounded before anything runs.

A recipe that asks for 10,000 threads, or for an input with 2^40 rows, used to
start them or allocate until the kernel killed the process. Each bound here names
the key to change:

- `evaluate.threads` above the cores this process may use is capped to them (a
  `warning:` line says so): recipes travel between machines, and more threads than
  cores only makes the latency figures worse;
- `evaluate.batch_sizes` stay inside the batch dim's [min, max]: latency measured at
  a batch the model does not declare is not a figure for that model; it and each sweep
  measure at most MAX_POINTS values (each one is a full latency measurement);
- the inputs at their largest shape (every dim at `max`), the data sets (`samples`
  at the `opt` shape) and one accuracy batch must each fit in half of this
  machine's memory. Inputs are a lower bound of what running the model needs (its
  activations come on top), so a recipe refused here could never have run.
"""
from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import numpy as np

from optpipe.core.errors import RecipeError
from optpipe.recipe.schema import InputSpec, Recipe

if TYPE_CHECKING:
    from optpipe.hardware.container_limits import ContainerLimits

log = logging.getLogger("optpipe.recipe.schema")


def available_cores(limits: ContainerLimits | None = None) -> int:
    """The cores this process may run on (its CPU affinity), fewer where a container's CPU quota pays for fewer:
    threads beyond the quota are throttled, which turns latency figures into noise. `limits`: the cgroup's, where the
    caller read them already."""
    from optpipe.hardware.container_limits import read_limits

    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        cores = max(1, os.cpu_count() or 1)
    quota = (limits or read_limits()).cores()
    return cores if quota is None else min(cores, quota)


def memory_budget() -> int:
    """Half the memory this process may use (the machine's, or a container's limit where lower), in bytes:
    what inputs alone may take at most."""
    from optpipe.hardware.container_limits import read_limits

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30  # unknown: assume a small machine
    limit = read_limits().memory_limit
    return (total if limit is None else min(total, limit)) // 2


# Latency points one evaluation measures per list: each costs warmup + iterations runs of the model.
MAX_POINTS = 64


def check_resources(recipe: Recipe, origin: str) -> None:
    _cap_threads(recipe)
    _check_batch_sizes(recipe, origin)
    _check_point_counts(recipe, origin)
    budget = memory_budget()
    _check_largest_inputs(recipe, origin, budget)
    _check_data_sets(recipe, origin, budget)


def _cap_threads(recipe: Recipe) -> None:
    from optpipe.hardware.container_limits import read_limits

    limits = read_limits()
    cores, quota = available_cores(limits), limits.cpu_quota
    if recipe.evaluate.threads > cores:
        why = f" (this container's CPU quota is {quota:g} CPUs)" if limits.cores() == cores else ""
        log.warning("evaluate.threads: %d is more than the %d cores available%s; using %d", recipe.evaluate.threads, cores,
                    why, cores)
        recipe.evaluate.threads = cores
    if quota is not None and quota < 1:
        # Even one thread runs out of a quota under one CPU in every period and waits for the next: the waits land
        # in the timed calls (each figure then says so, flagged busy: optpipe.evaluation.cpu_contention).
        log.warning("this container's CPU quota is %g CPUs, under one: every latency figure includes the quota's waits "
                    "(flagged busy); give the container at least one whole CPU to measure", quota)


def _check_batch_sizes(recipe: Recipe, origin: str) -> None:
    batch = recipe.batch_dim()
    if batch is None:
        return  # a fixed batch: batch_sizes are not used
    rng = recipe.dims[batch]
    for size in recipe.evaluate.batch_sizes:
        if not rng.min <= size <= rng.max:
            raise RecipeError(
                f"{origin}: evaluate.batch_sizes: {size} is outside dims.{batch} [{rng.min}, {rng.max}]; "
                f"use sizes in that range or widen dims.{batch}"
            )


def _check_point_counts(recipe: Recipe, origin: str) -> None:
    lists = {"evaluate.batch_sizes": recipe.evaluate.batch_sizes}
    lists.update({f"evaluate.sweep.{dim}": recipe.sweep_values(dim) for dim in recipe.evaluate.sweep})
    for key, values in lists.items():
        if len(set(values)) > MAX_POINTS:
            raise RecipeError(
                f"{origin}: {key}: {len(set(values))} values to measure, more than {MAX_POINTS}; each is a full latency "
                "measurement, pick fewer (e.g. powers of two)"
            )


def _bytes(spec: InputSpec, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(spec.dtype).itemsize


def _check_largest_inputs(recipe: Recipe, origin: str, budget: int) -> None:
    for spec in recipe.inputs:
        shape = recipe.shape_at(spec, "max")
        size = _bytes(spec, shape)
        if size > budget:
            dims = [f"dims.{d}.max" for d in dict.fromkeys(d for d in spec.shape if isinstance(d, str))]
            fix = f"lower {' or '.join(dims)}" if dims else f"shrink inputs.{recipe.inputs.index(spec)}.shape"
            raise RecipeError(
                f"{origin}: input '{spec.name}' at its largest shape {list(shape)} {spec.dtype} takes {_human(size)}, "
                f"more than half this machine's memory ({_human(budget)}); {fix}"
            )


def _check_data_sets(recipe: Recipe, origin: str, budget: int) -> None:
    batch = recipe.batch_dim()
    one = sum(_bytes(spec, recipe.shape_at(spec, **({batch: 1} if batch else {}))) for spec in recipe.inputs)
    for which in ("eval", "calibration"):
        source = getattr(recipe.data, which)
        if source is not None and source.samples * one > budget:
            raise RecipeError(
                f"{origin}: data.{which}.samples: {source.samples} samples of {_human(one)} take {_human(source.samples * one)}, "
                f"more than half this machine's memory ({_human(budget)}); lower data.{which}.samples"
            )
    if batch and recipe.evaluate.accuracy_batch * one > budget:
        raise RecipeError(
            f"{origin}: evaluate.accuracy_batch: {recipe.evaluate.accuracy_batch} samples of {_human(one)} do not fit in "
            f"half this machine's memory ({_human(budget)}); lower evaluate.accuracy_batch"
        )


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"
