"""What TensorRT offers here: whether it can build at all, and which builder features the installed version has."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from optpipe.core.runtime import cuda_available


@dataclass(frozen=True)
class TrtFeatures:
    """What the TensorRT at hand offers, probed by attribute (versions removed things at different times)."""

    version: str
    strongly_typed: bool
    fp16_flag: bool
    int8_flag: bool
    calibrator: bool


# What the build command is written for when TensorRT is not here: TensorRT 10, the current
# major on PyPI (strongly typed networks; builder flags and calibrators deprecated, still present).
ASSUMED_FEATURES = TrtFeatures(version="10.x", strongly_typed=True, fp16_flag=True, int8_flag=True, calibrator=True)


def tensorrt_missing() -> Optional[str]:
    """None where an engine can be built here; else the one-line reason."""
    try:
        import tensorrt  # noqa: F401
    except Exception:  # ImportError, or a broken install failing to load its libraries
        return "TensorRT is not installed here (`import tensorrt` fails)"
    if not cuda_available():
        return "no CUDA device here"
    return None


def probe_features() -> TrtFeatures:
    import tensorrt as trt

    return TrtFeatures(
        version=trt.__version__,
        strongly_typed=hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"),
        fp16_flag=hasattr(trt.BuilderFlag, "FP16"),
        int8_flag=hasattr(trt.BuilderFlag, "INT8"),
        calibrator=hasattr(trt, "IInt8EntropyCalibrator2"),
    )
