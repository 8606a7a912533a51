"""Inference sessions with the measured settings: ONNX Runtime (pinned threads) and PyTorch eager."""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

Feeds = dict[str, np.ndarray]
Outputs = dict[str, np.ndarray]


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """A CUDA device that ONNX Runtime can use (the provider being listed is not enough).

    Asked of the CUDA driver itself (cuInit, cuDeviceGetCount) rather than through torch: every run
    asks this for its cache keys, and importing torch for it took seconds of a fully cached rerun.
    """
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver on this machine
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def cuda_device_names() -> list[str]:
    """The names of the CUDA devices this process sees ("NVIDIA H200"); [] without one.

    Asked of the CUDA driver (cuDeviceGetName), which honours CUDA_VISIBLE_DEVICES as a Ray task's
    GPUs are given; nvidia-smi only where libcuda cannot be loaded; never through torch (seconds to import).
    """
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return _nvidia_smi_names()
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    names = []
    for index in range(count.value):
        device, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
        if driver.cuDeviceGet(ctypes.byref(device), index) == 0 and driver.cuDeviceGetName(name, len(name), device) == 0:
            names.append(name.value.decode(errors="replace").strip())
    return names


def _nvidia_smi_names() -> list[str]:
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []  # the devices are hidden from this process (nvidia-smi would list them anyway)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def requested_providers(recipe: str = "auto", run: str = "auto") -> str:
    """Where to evaluate: the run's explicit choice (the Python API's `providers`), else the recipe's
    `evaluate.providers`. Executors ask this too, to give a GPU to the evaluations that will use one."""
    return run if run != "auto" else recipe


REQUESTED_PROVIDER = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def pick_providers(requested: str = "auto") -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested == "cpu":
        return ["CPUExecutionProvider"]
    gpu = "CUDAExecutionProvider" in available and cuda_available()
    if requested == "tensorrt" and gpu and "TensorrtExecutionProvider" in available:
        chosen = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    elif requested in ("auto", "cuda", "tensorrt") and gpu:
        chosen = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        chosen = ["CPUExecutionProvider"]
    if requested in REQUESTED_PROVIDER and chosen[0] != REQUESTED_PROVIDER[requested]:
        _fell_back(requested, chosen[0], gpu)
    return chosen


@functools.lru_cache(maxsize=None)
def _fell_back(requested: str, chosen: str, gpu: bool) -> None:
    """Said once per process: figures from another provider than asked for must not pass unremarked."""
    import logging

    why = "ONNX Runtime here has no TensorRT provider" if gpu else "ONNX Runtime here has no usable CUDA device"
    logging.getLogger("optpipe.core.runtime").warning(
        f"evaluate.providers: {requested}, but {why}; evaluating with {chosen} (the report's provider column says so)")


def session_options(threads: int, optimization: str = "all"):
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = levels[optimization]
    # FATAL only: a run that fails (a Reshape at a shape the export's checks try) raises, and its message is in the
    # exception optpipe reports; at ERROR the C++ logger also printed it, colored, between optpipe's lines.
    options.log_severity_level = 4
    # No spin-waiting between runs: an idle session's spinning threads starve whatever else is
    # measured in the process (PyTorch eager went from 20 to 38 ms beside one), at no cost to ORT.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def ort_session(path: Path, threads: int, providers: list[str] | None = None, optimization: str = "all"):
    import onnxruntime as ort

    return ort.InferenceSession(
        str(path), sess_options=session_options(threads, optimization), providers=providers or ["CPUExecutionProvider"]
    )


#: A decoder exported with its KV cache (optpipe/source/decoder_export.py) takes these beside the tokens.
PAST_PREFIX, MASK_NAME, TOKENS_NAME = "past_key_values.", "attention_mask", "input_ids"
DECODER_IDS = "decoder_input_ids"  # an encoder-decoder's target tokens (T5, BART, Marian, Whisper): [batch, target]


def prefill_feeds(feeds: Feeds, inputs: list[tuple[str, list]]) -> Feeds:
    """The feeds of one forward through a KV-cache decoder: the recipe's inputs name only the tokens, the
    graph also takes an attention mask and a past key/value per layer. Every one-forward run (a pass's
    self-check, a guard, a target's timing) is then the prefill: a mask of ones and an empty past (length
    0, which ONNX Runtime and OpenVINO take). `inputs`: the graph's (name, shape); other graphs unchanged."""
    if TOKENS_NAME not in feeds or not any(name.startswith(PAST_PREFIX) for name, _ in inputs):
        return feeds
    batch, sequence = np.shape(feeds[TOKENS_NAME])[:2]
    completed = dict(feeds)
    for name, shape in inputs:
        if name in completed:
            continue
        if name == MASK_NAME:
            completed[name] = np.ones((batch, sequence), np.int64)
        elif name.startswith(PAST_PREFIX) and len(shape) == 4 and all(isinstance(d, int) for d in (shape[1], shape[3])):
            completed[name] = np.zeros((batch, shape[1], 0, shape[3]), np.float32)
    return completed


def join_batches(outs: Sequence[Outputs]) -> Outputs:
    """Each output over all batches, along axis 0. An output with no axis (a 0-d loss, a score of the whole batch)
    gives one element per batch: np.concatenate refuses 0-d arrays, and a scalar output failed every stage."""
    return {name: join_arrays([np.asarray(o[name]) for o in outs]) for name in outs[0].keys()}


def join_arrays(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.atleast_1d(p) for p in parts])


def first_non_finite(arrays: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray] | None = None) -> tuple[str, int, int] | None:
    """The first float array holding NaN or Inf: (its name, how many such values, its size); None where all are finite.
    `like`: arrays whose ±inf at the same place are allowed (a model that means -inf, masked logits); NaN never is.
    Given `arrays` itself, every infinity is allowed."""
    for name, value in arrays.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            bad = ~np.isfinite(value)
            other = None if like is None else like.get(name)
            if other is not None and np.shape(other) == value.shape:
                bad &= ~(np.isinf(value) & (value == np.asarray(other)))
            if bad.any():
                return name, int(bad.sum()), value.size
    return None


def ort_runner(session) -> Callable[[Feeds], Outputs]:
    names = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    shapes = [(i.name, list(i.shape)) for i in session.get_inputs()]

    def run(feeds: Feeds) -> Outputs:
        feeds = prefill_feeds(feeds, shapes)
        return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in inputs})))

    return run


def eager_runner(torch_model, threads: int) -> Callable[[Feeds], Outputs]:
    """PyTorch eager as a runner. torch.from_numpy shares the array's memory: a forward() that writes into its input in
    place (`x.mul_(2)`) wrote into the evaluation data every later stage and timing reads (its second call then read
    2x, and the random-forward check blamed noise). The first call finds out, on a copy kept aside, and puts the data
    back; from then on such a model runs on copies, and every other model still without one (no copy timed)."""
    import torch

    torch.set_num_threads(threads)
    module = torch_model.module
    writes_inputs: bool | None = None  # None until the first call has looked

    def forward(arrays: list[np.ndarray]) -> Outputs:
        # no_grad, not inference_mode: a model that caches tensors in forward (a detector's grid)
        # would keep inference tensors, and exporting it afterwards fails ("cannot be saved for backward").
        with torch.no_grad():
            outs = module(*[torch.from_numpy(a) for a in arrays])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return {name: tensor_to_numpy(out) for name, out in zip(torch_model.output_names, outs)}

    def run(feeds: Feeds) -> Outputs:
        nonlocal writes_inputs
        arrays = [np.ascontiguousarray(feeds[n]) for n in torch_model.input_names]
        if writes_inputs is not None:
            return forward([a.copy() for a in arrays] if writes_inputs else arrays)
        kept = [a.copy() for a in arrays]
        try:
            return forward(arrays)
        finally:
            written = [i for i, (a, b) in enumerate(zip(arrays, kept)) if not np.array_equal(a, b, equal_nan=True)]
            for i in written:
                arrays[i][...] = kept[i]
            writes_inputs = bool(written)

    return run


@contextmanager
def as_exported() -> Iterator[None]:
    """PyTorch eager as every exporter traces it: without the fast path of nn.MultiheadAttention / nn.TransformerEncoder
    in eval mode, which under a padding mask runs on nested tensors and writes other values at the padded positions (an
    nn.TransformerEncoder's export read 47% of its elements out of tolerance, every stage with it, on positions no
    user reads). The outputs stages are compared against run so; eager's timing keeps the fast path, the speed its
    users get."""
    import torch

    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def torch_inputs(feeds: Feeds, names: Sequence[str]) -> tuple:
    """The feeds as torch tensors of their own: a forward() writing into its input in place leaves the arrays be."""
    import torch

    return tuple(torch.from_numpy(np.array(feeds[name])) for name in names)


def tensor_to_numpy(tensor) -> np.ndarray:
    """A torch output as numpy; bfloat16, which numpy has no type for, widened to float32 (exactly)."""
    import torch

    tensor = tensor.detach()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


@contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """Pin this process to `threads` cores while measuring, so numbers don't wander across cores."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    cores = sorted(before)[:threads]
    try:
        os.sched_setaffinity(0, cores)
        yield
    finally:
        os.sched_setaffinity(0, before)


def resize_dim(array: np.ndarray, axes: list[int], size: int) -> np.ndarray:
    """The array with each axis in `axes` cut or cyclically repeated to `size`: real values, new length."""
    for axis in axes:
        array = np.take(array, np.arange(size) % array.shape[axis], axis=axis)
    return array
