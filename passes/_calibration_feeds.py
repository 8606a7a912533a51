"""data.calibration as the batches a graph takes, for the passes that hand them to NNCF (OpenVINO's and ONNX's)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from optpipe.calibration.readers import sample_batches
from optpipe.core.runtime import prefill_feeds

if TYPE_CHECKING:
    from optpipe.pass_infra.pass_base import PassContext


def calibration_feeds(ctx: "PassContext", shapes: list[tuple[str, list]]) -> list[dict[str, np.ndarray]]:
    """The calibration set in batches the graph (its inputs' (name, shape)) takes: one sample each, or a model without
    a batch dim's fixed batch (a trailing partial batch dropped: the model cannot take it). A KV-cache decoder's
    forward also takes a mask and a past per layer: each batch is completed to its prefill."""
    from optpipe.evaluation.guard import accuracy_batch

    size = 1 if ctx.inputs.batch_dim() else accuracy_batch(ctx.inputs, ctx.evaluate)
    return [prefill_feeds(b, shapes) for b in sample_batches(ctx.calibration_set(), size, whole=True)]
