"""Peak memory of a block of work: host RSS above the level before it, and device memory on GPU.

Host: Linux keeps the process's RSS high-water mark (VmHWM); writing "5" to
/proc/self/clear_refs resets it to the current RSS, so the mark after the block
is the block's peak. Where that is not possible, a thread samples VmRSS (or
psutil's rss) every few milliseconds instead. Device: ONNX Runtime has no API for
its CUDA arena's peak, so the device's used memory is sampled (torch.cuda).
"""
from __future__ import annotations

import threading
from pathlib import Path

from optpipe.core.results import Memory

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
SAMPLE_EVERY_S = 0.005


class PeakMemory:
    """with PeakMemory(device=...) as peak: ...; then peak.result() -> Memory."""

    def __init__(self, device: bool = False):
        self.device = device
        self._baseline_rss = 0
        self._high_water = False
        self._sampled_rss = 0
        self._device_base = 0
        self._device_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        self._baseline_rss = current_rss()
        self._high_water = _reset_high_water()
        if self.device:
            self._device_base = self._device_peak = _device_used() or 0
        if not self._high_water or self.device:
            self._sampled_rss = self._baseline_rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak_rss = _high_water() if self._high_water else max(self._sampled_rss, current_rss())

    def result(self) -> Memory:
        host = max(0, self._peak_rss - self._baseline_rss)
        device = max(0, self._device_peak - self._device_base) if self.device else None
        return Memory(host_rss_bytes=host, device_bytes=device)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            if not self._high_water:
                self._sampled_rss = max(self._sampled_rss, current_rss())
            if self.device:
                self._device_peak = max(self._device_peak, _device_used() or 0)


def current_rss() -> int:
    value = _status_kb("VmRSS")
    if value is not None:
        return value
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # no /proc and no psutil: memory is reported as unknown (0 increase)
        return 0


def _high_water() -> int:
    return _status_kb("VmHWM") or current_rss()


def _reset_high_water() -> bool:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


def _status_kb(field: str) -> int | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _device_used() -> int | None:
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free
    except Exception:  # no CUDA device or no torch: no device figure
        return None
