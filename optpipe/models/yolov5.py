"""YOLOv5 (v6.0+ layout: CSP-Darknet backbone with C3 blocks and SPPF, PANet neck, Detect head),
written after ultralytics' models/yolov5s.yaml and models/common.py, models/yolo.py.

Why not the `yolov5` PyPI package: `pip install yolov5` pulls ultralytics, opencv, roboflow, CUDA
wheels and a newer torch (measured with `pip install --dry-run`: torch 2.13 -> 2.14.1), which the
default install must not change; its network code is not importable without those packages.

Weights are random (seeded): none can be fetched here. With random weights and default batch-norm
statistics the activations drift until every image gives the same output (the issue measured
3e-4 px between images), so `calibrate_batchnorm` re-estimates each BatchNorm's statistics on real
photographs: activations stay normalised and the outputs depend on the image.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# models/yolov5s.yaml: anchors in pixels per output level (strides 8, 16, 32)
ANCHORS = ((10, 13, 16, 30, 33, 23), (30, 61, 62, 45, 59, 119), (116, 90, 156, 198, 373, 326))
STRIDES = (8, 16, 32)
SIZES = {"n": (0.33, 0.25), "s": (0.33, 0.50), "m": (0.67, 0.75), "l": (1.0, 1.0)}  # depth, width multiples


class Conv(nn.Module):
    """Conv2d (no bias) + BatchNorm + SiLU, 'same' padding."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2 if p is None else p, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c1: int, c2: int, shortcut: bool = True):
        super().__init__()
        self.cv1 = Conv(c1, c2, 1)
        self.cv2 = Conv(c2, c2, 3)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP bottleneck with 3 convolutions."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True):
        super().__init__()
        c_ = c2 // 2
        self.cv1 = Conv(c1, c_, 1)
        self.cv2 = Conv(c1, c_, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut) for _ in range(n)))

    def forward(self, x):
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max pools."""

    def __init__(self, c1: int, c2: int, k: int = 5):
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1)
        self.cv2 = Conv(c_ * 4, c2, 1)
        self.m = nn.MaxPool2d(k, 1, k // 2)

    def forward(self, x):
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Detect(nn.Module):
    """Per level a 1x1 conv to anchors x (box, objectness, classes), decoded to pixel boxes.

    Like ultralytics' Detect, it caches its grids in forward and rebuilds them when the feature
    map size changes: the class of model that failed export when its reference ran under inference_mode."""

    def __init__(self, classes: int, channels: tuple[int, ...]):
        super().__init__()
        self.no = classes + 5
        self.na = len(ANCHORS[0]) // 2
        self.m = nn.ModuleList(nn.Conv2d(c, self.na * self.no, 1) for c in channels)
        self.register_buffer("anchors", torch.tensor(ANCHORS, dtype=torch.float32).view(len(ANCHORS), self.na, 2))
        self.grid = [torch.empty(0) for _ in channels]
        self.anchor_grid = [torch.empty(0) for _ in channels]

    def forward(self, features):
        out = []
        for i, x in enumerate(features):
            x = self.m[i](x)
            bs, _, ny, nx = x.shape
            x = x.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            # Rebuilt while exporting, as ultralytics' Detect does with `dynamic`: a cached grid would be
            # frozen into the graph at the trace size.
            if self.grid[i].shape[2:4] != x.shape[2:4] or torch.compiler.is_compiling() or torch.jit.is_tracing():
                self.grid[i], self.anchor_grid[i] = self._make_grid(nx, ny, i)
            xy, wh, conf = x.sigmoid().split((2, 2, self.no - 4), 4)
            xy = (xy * 2 + self.grid[i]) * STRIDES[i]
            wh = (wh * 2) ** 2 * self.anchor_grid[i]
            out.append(torch.cat((xy, wh, conf), 4).view(bs, self.na * nx * ny, self.no))
        return torch.cat(out, 1)

    def _make_grid(self, nx: int, ny: int, i: int):
        yv, xv = torch.meshgrid(torch.arange(ny, dtype=torch.float32), torch.arange(nx, dtype=torch.float32), indexing="ij")
        grid = torch.stack((xv, yv), 2).expand(1, self.na, ny, nx, 2) - 0.5
        anchor_grid = self.anchors[i].view(1, self.na, 1, 1, 2).expand(1, self.na, ny, nx, 2)
        return grid, anchor_grid

    def initialize_biases(self) -> None:
        """ultralytics' prior: objectness for ~8 objects per 640 image, classes near 0.6 / classes."""
        for conv, stride in zip(self.m, STRIDES):
            b = conv.bias.view(self.na, -1)
            b.data[:, 4] += math.log(8 / (640 / stride) ** 2)
            b.data[:, 5:] += math.log(0.6 / (self.no - 5 - 0.99))


class YOLOv5(nn.Module):
    """[batch, 3, H, W] RGB in [0, 1], H and W multiples of 32 -> [batch, anchors, 5 + classes]:
    box centre x, y and width, height in pixels, objectness, class scores (sigmoid)."""

    output_names = ["detections"]

    def __init__(self, size: str = "s", classes: int = 80):
        super().__init__()
        depth, width = SIZES[size]
        n = lambda k: max(round(k * depth), 1)  # noqa: E731
        c = lambda k: math.ceil(k * width / 8) * 8  # noqa: E731
        self.backbone = nn.ModuleList([
            Conv(3, c(64), 6, 2, 2), Conv(c(64), c(128), 3, 2), C3(c(128), c(128), n(3)),                 # 0-2   P2/4
            Conv(c(128), c(256), 3, 2), C3(c(256), c(256), n(6)),                                        # 3-4   P3/8
            Conv(c(256), c(512), 3, 2), C3(c(512), c(512), n(9)),                                        # 5-6   P4/16
            Conv(c(512), c(1024), 3, 2), C3(c(1024), c(1024), n(3)), SPPF(c(1024), c(1024)),             # 7-9   P5/32
        ])
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.lateral5 = Conv(c(1024), c(512), 1)                                                         # 10
        self.top_down4 = C3(c(1024), c(512), n(3), shortcut=False)                                       # 13
        self.lateral4 = Conv(c(512), c(256), 1)                                                          # 14
        self.top_down3 = C3(c(512), c(256), n(3), shortcut=False)                                        # 17 P3 out
        self.down3 = Conv(c(256), c(256), 3, 2)                                                          # 18
        self.bottom_up4 = C3(c(512), c(512), n(3), shortcut=False)                                       # 20 P4 out
        self.down4 = Conv(c(512), c(512), 3, 2)                                                          # 21
        self.bottom_up5 = C3(c(1024), c(1024), n(3), shortcut=False)                                     # 23 P5 out
        self.detect = Detect(classes, (c(256), c(512), c(1024)))

    def forward(self, x):
        saved = {}
        for i, layer in enumerate(self.backbone):
            x = layer(x)
            saved[i] = x
        p5 = self.lateral5(x)
        p4 = self.lateral4(self.top_down4(torch.cat((self.up(p5), saved[6]), 1)))
        out3 = self.top_down3(torch.cat((self.up(p4), saved[4]), 1))
        out4 = self.bottom_up4(torch.cat((self.down3(out3), p4), 1))
        out5 = self.bottom_up5(torch.cat((self.down4(out4), p5), 1))
        return self.detect([out3, out4, out5])


def calibrate_batchnorm(model: nn.Module, images: torch.Tensor) -> None:
    """Set every BatchNorm's running mean/var to the statistics of its input on `images`
    (one cumulative pass in train mode), so random weights still give image-dependent outputs."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the calibration pass
    model.train()
    with torch.no_grad():
        model(images)
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = 0.03


def calibration_photos(size: int, count: int = 8) -> torch.Tensor:
    """`count` photographs shipped with scikit-image, resized to size x size, RGB in [0, 1]."""
    import numpy as np
    from PIL import Image

    from optpipe.calibration.sources import package_path

    folder = package_path("package:skimage/data")
    names = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "hubble_deep_field.jpg",
             "retina.jpg", "ihc.png", "coins.png", "brick.png", "grass.png", "gravel.png"][:count]
    arrays = []
    for name in names:
        with Image.open(folder / name) as image:
            arrays.append(np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR), np.float32) / 255)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def yolov5(size: str = "s", classes: int = 80, seed: int = 0, calibration_size: int = 320) -> YOLOv5:
    """A YOLOv5 of the given size with seeded random weights and photo-calibrated batch norms."""
    if size not in SIZES:
        raise ValueError(f"size '{size}' is not one of {', '.join(SIZES)}")
    torch.manual_seed(seed)
    model = YOLOv5(size, classes)
    model.detect.initialize_biases()
    calibrate_batchnorm(model, calibration_photos(calibration_size))
    model.detect.grid = [torch.empty(0) for _ in STRIDES]  # made again at the export size
    model.detect.anchor_grid = [torch.empty(0) for _ in STRIDES]
    return model.eval()
