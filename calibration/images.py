"""A folder of images -> one model input, with the recipe's preprocessing.

`data.<set>.preprocess` (all optional):

    files:   [astronaut.png, "*.jpg"]   names or glob patterns inside the folder (default: every image)
    resize:  256 | [h, w]               shorter side to 256 keeping the aspect ratio, or an exact size
                                        (default: the crop size * 256/224, as in ImageNet evaluation)
    crop:    224 | [h, w]               center crop (default: the input's fixed spatial dims)
    scale:   0.00392156                 pixel values are multiplied by this first (default 1/255)
    mean:    [0.485, 0.456, 0.406]      then normalised per channel, one value or one per channel
    std:     [0.229, 0.224, 0.225]      (default: ImageNet's; for 1 or 4 channels their average)
    layout:  NCHW | NHWC                (default: from where the input's 1, 3 or 4 channels are)
    channels: rgb | bgr | gray | rgba   (default: from the input's channel count: 1 gray, 3 rgb, 4 rgba)
    input:   images                     which model input (default: the only rank-4 input)

The dtype is the input's: float inputs get scale/mean/std, uint8 inputs get raw pixels.
When `samples` exceeds the number of images, later passes over the folder use
horizontally flipped and randomly (seeded) placed crops, so no two samples are identical.
Images are decoded with Pillow.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from optpipe.core.errors import DataError
from optpipe.recipe.schema import DataSource, InputSpec, ModelSource, describe_validation_error

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}
Size = Union[int, tuple[int, int]]


class ImagePreprocess(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: Optional[list[str]] = None
    resize: Optional[Size] = None
    crop: Optional[Size] = None
    scale: float = 1 / 255
    mean: Optional[list[float]] = None
    std: Optional[list[float]] = None
    layout: Optional[Literal["NCHW", "NHWC"]] = None
    channels: Optional[Literal["rgb", "bgr", "gray", "rgba"]] = None
    input: Optional[str] = None


# Channels each mode decodes to (Pillow mode), and ImageNet's statistics reduced to them.
CHANNEL_MODES = {"gray": ("L", 1), "rgb": ("RGB", 3), "bgr": ("RGB", 3), "rgba": ("RGBA", 4)}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load_image_folder(path: Path, source: DataSource, model: ModelSource) -> dict[str, np.ndarray]:
    """`source.samples` preprocessed images from `path`, stacked as the model input's array."""
    options = _options(source)
    spec = _image_input(model, options)
    layout = options.layout or _layout_of(spec)
    options = _with_channels(options, spec, layout)
    crop = _pair(options.crop) if options.crop is not None else _spatial_dims(spec, layout)
    files = image_files(path, options.files)
    rng = np.random.default_rng(source.seed)
    samples = []
    for index in range(source.samples):
        variant = index // len(files)
        image = _decode(files[index % len(files)], CHANNEL_MODES[options.channels][0])
        samples.append(_preprocess(image, options, crop, variant, rng, spec.dtype))
    batch = np.stack(samples)  # N, H, W, C
    if layout == "NCHW":
        batch = batch.transpose(0, 3, 1, 2)
    return {spec.name: np.ascontiguousarray(batch).astype(spec.dtype)}


def image_files(folder: Path, patterns: list[str] | None) -> list[Path]:
    """Image files of `folder` (not recursive), matched by `patterns` in their order, else all sorted by name."""
    if not folder.is_dir():
        raise DataError(f"data: images need a folder, and '{folder}' is not one; point `path` at a folder of images")
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if patterns:
        chosen: list[Path] = []
        for pattern in patterns:
            matched = [p for p in images if fnmatch.fnmatch(p.name, pattern) and p not in chosen]
            if not matched:
                raise DataError(f"data: preprocess.files: '{pattern}' matches no image in '{folder}'")
            chosen += matched
        images = chosen
    if not images:
        raise DataError(f"data: folder '{folder}' holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return images


def _options(source: DataSource) -> ImagePreprocess:
    try:
        options = ImagePreprocess.model_validate(source.preprocess)
    except ValidationError as exc:
        raise DataError(f"data: {describe_validation_error(exc, ImagePreprocess, source.preprocess, prefix='preprocess')}") from None
    if any(s == 0 for s in options.std or ()):
        raise DataError("data: preprocess.std: a standard deviation of 0 divides by zero; use positive values")
    return options


def _with_channels(options: ImagePreprocess, spec: InputSpec, layout: str) -> ImagePreprocess:
    """The channel mode and per-channel statistics, filled in from the input's channel count."""
    count = spec.shape[1] if layout == "NCHW" else spec.shape[3]
    by_count = {1: "gray", 3: "rgb", 4: "rgba"}
    mode = options.channels or by_count.get(count)
    if mode is None or CHANNEL_MODES[mode][1] != count:
        raise DataError(
            f"data: input '{spec.name}' takes {count} channels, which images give only as 1 (gray), 3 (rgb/bgr) or "
            f"4 (rgba){f'; preprocess.channels {mode} gives {CHANNEL_MODES[mode][1]}' if mode else ''}; "
            "fix preprocess.channels or use an npy/npz source"
        )
    stats = {}
    for key, imagenet in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        value = getattr(options, key) or ([*imagenet] if count == 3 else [sum(imagenet) / 3] * count)
        if len(value) == 1:
            value = value * count
        if len(value) != count:
            raise DataError(f"data: preprocess.{key} has {len(value)} values; input '{spec.name}' has {count} channels, give 1 or {count}")
        stats[key] = value
    return options.model_copy(update={"channels": mode, **stats})


def _image_input(model: ModelSource, options: ImagePreprocess) -> InputSpec:
    if options.input is not None:
        spec = next((s for s in model.inputs if s.name == options.input), None)
        if spec is None:
            raise DataError(f"data: preprocess.input: the model has no input '{options.input}'")
        return spec
    candidates = [s for s in model.inputs if len(s.shape) == 4]
    if len(candidates) != 1:
        raise DataError("data: images feed one rank-4 input; name it with `preprocess: {input: NAME}`")
    return candidates[0]


def _layout_of(spec: InputSpec) -> str:
    if spec.shape[1] in (1, 3, 4):
        return "NCHW"
    if spec.shape[3] in (1, 3, 4):
        return "NHWC"
    raise DataError(f"data: cannot tell the layout of input '{spec.name}' {spec.shape}; set `preprocess: {{layout: NCHW}}`")


def _spatial_dims(spec: InputSpec, layout: str) -> tuple[int, int]:
    h, w = (spec.shape[2], spec.shape[3]) if layout == "NCHW" else (spec.shape[1], spec.shape[2])
    if not (isinstance(h, int) and isinstance(w, int)):
        raise DataError(f"data: input '{spec.name}' has dynamic height/width; set `preprocess: {{crop: SIZE}}`")
    return h, w


def _pair(size: Size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _decode(path: Path, mode: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return _eight_bit(image).convert(mode)
    except Image.DecompressionBombError as exc:  # not an OSError: it had ended the run as an internal error
        # Pillow's limit stays as it is: a few KB of PNG that decode to gigabytes is how a decompression bomb looks.
        raise DataError(f"data: image '{path}' is too large to decode safely ({exc}); remove it, or shrink it "
                        "first") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"data: cannot decode image '{path}' ({exc}); remove it or list others in preprocess.files") from None


def _eight_bit(image):
    """A 16-bit or float image (PNG/TIFF modes I;16, I, F) scaled to 8 bits by its format's range: Pillow's
    convert('RGB') clips them at 255, which turned a 16-bit PNG 99.6% white (measured), silently: calibration
    and the accuracy figures ran on blank images. 8-bit modes pass through."""
    from PIL import Image

    if not (image.mode.startswith("I") or image.mode == "F"):
        return image
    values = np.asarray(image, dtype=np.float64)
    top = float(values.max()) if values.size else 0.0
    if image.mode == "F" and top <= 1.0:
        scale = 255.0  # a float image in [0, 1]
    elif top <= 255:
        scale = 1.0
    elif top <= 65535:
        scale = 255.0 / 65535.0  # 16 bits, whatever this image's own maximum
    else:
        scale = 255.0 / top
    return Image.fromarray(np.clip(np.rint(values * scale), 0, 255).astype(np.uint8), "L")


def _preprocess(image, options: ImagePreprocess, crop: tuple[int, int], variant: int, rng, dtype: str) -> np.ndarray:
    """Resize, crop (center on the first pass, flipped/shifted on later ones), normalise; returns HWC."""
    from PIL import Image

    image = image.resize(_resized(image.size, options.resize, crop), Image.Resampling.BILINEAR)
    width, height = image.size
    ch, cw = crop
    if ch > height or cw > width:
        raise DataError(f"data: preprocess.crop {list(crop)} is larger than the resized image ({height}x{width}); raise `resize`")
    top, left = (height - ch) // 2, (width - cw) // 2
    if variant > 0:
        top, left = int(rng.integers(0, height - ch + 1)), int(rng.integers(0, width - cw + 1))
    pixels = np.asarray(image.crop((left, top, left + cw, top + ch)), dtype=np.float32)
    if pixels.ndim == 2:
        pixels = pixels[..., None]  # grayscale: one channel axis
    if variant % 2 == 1:
        pixels = pixels[:, ::-1]
    if options.channels == "bgr":
        pixels = pixels[..., ::-1]
    if np.dtype(dtype).kind == "f":
        pixels = (pixels * options.scale - np.asarray(options.mean, np.float32)) / np.asarray(options.std, np.float32)
    return pixels


def _resized(size: tuple[int, int], resize: Size | None, crop: tuple[int, int]) -> tuple[int, int]:
    """PIL (width, height) after resizing: the shorter side to `resize` (aspect kept), or exactly [h, w]."""
    width, height = size
    if resize is None:
        resize = round(max(crop) * 256 / 224)
    if not isinstance(resize, int):
        return int(resize[1]), int(resize[0])
    ratio = resize / min(width, height)
    return max(1, round(width * ratio)), max(1, round(height * ratio))
