"""int8 on an LSTM text classifier built here: the recurrent layer is quantized where ORT can
(DynamicQuantizeLSTM), and the guard can always fall back to the last quantized nodes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from helpers_passes import artifact_of, context, graph_recipe, run_model
from optpipe.core.errors import PassError
from optpipe.passes.int8 import Int8Params, Int8Pass

VOCAB = 50


class LSTMText(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, ids):
        states, _ = self.lstm(self.embed(ids))
        return self.head(states[:, -1])


@pytest.fixture(scope="module")
def lstm_onnx(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lstm") / "lstm.onnx"
    torch.onnx.export(LSTMText().eval(), (torch.randint(0, VOCAB, (2, 12)),), str(path), dynamo=False,
                      input_names=["ids"], output_names=["logits"], dynamic_axes={"ids": {0: "N", 1: "T"}, "logits": {0: "N"}})
    return path


def _run(lstm_onnx, tmp_path, cosine_min, **params):
    recipe = graph_recipe([{"name": "ids", "dtype": "int64", "shape": ["N", "T"]}],
                          dims={"N": {"min": 1, "opt": 4, "max": 16}, "T": {"min": 1, "opt": 12, "max": 32}},
                          tolerance={"cosine_min": cosine_min})
    ids = {"ids": np.random.default_rng(0).integers(0, VOCAB, (16, 12)).astype(np.int64)}
    model = artifact_of(onnx.load(str(lstm_onnx)), tmp_path / "in")
    return model, Int8Pass(Int8Params(mode="dynamic", **params)).run(model, context(recipe, tmp_path / "work", ids)), ids


def test_dynamic_int8_quantizes_the_lstm_itself(lstm_onnx, tmp_path):
    _, artifact, _ = _run(lstm_onnx, tmp_path, cosine_min=0.99)
    info = artifact.info
    assert info["op_changes"].get("com.microsoft.DynamicQuantizeLSTM") == 1 and info["op_changes"]["LSTM"] == -1
    # The LSTM is ~99.8% of the MACs: before, only the head was int8 (0.2% of them).
    assert info["coverage"]["macs"].get("int8", 0) > 0.95, info["coverage"]
    assert info["guard"]["held"] and info["guard"]["cosine"] > 0.999 and info["guard"]["unconverted"] is None  # measured 0.99999


def test_lstm_weights_stay_symmetric_even_where_the_format_gives_zero_points(lstm_onnx, tmp_path):
    """DynamicQuantizeLSTM takes no weight zero point: u8s8-reduce-range (asymmetric elsewhere) writes
    symmetric weights here and says why; asking for zero points is refused in one line."""
    _, artifact, _ = _run(lstm_onnx, tmp_path / "rr", cosine_min=0.99, format="u8s8-reduce-range")
    chosen = artifact.info["int8_format"]
    assert chosen["weight_symmetric"] is True and "LSTM" in chosen["why"]
    with pytest.raises(PassError, match="LSTM takes symmetric weights only; remove weight_symmetric"):
        _run(lstm_onnx, tmp_path / "forced", cosine_min=0.99, format="u8s8-reduce-range", weight_symmetric=False)
    # Without the LSTM among the ops to quantize, the head gets its zero points.
    _, head_only, _ = _run(lstm_onnx, tmp_path / "head", cosine_min=0.9, format="u8s8-reduce-range", op_types=["Gemm"])
    assert head_only.info["int8_format"]["weight_symmetric"] is False


def test_the_one_quantized_node_blamed_is_kept_in_float_and_the_stage_says_it_is_the_fp32_model(lstm_onnx, tmp_path):
    """Only the head quantized (a Gemm, which ORT's dynamic quantizer renames to `<name>_MatMul` before it
    reads the exclusions); a tolerance its int8 error breaks: keeping it in float is the FP32 model, and the
    guard says so instead of "no node left to blame"."""
    model, artifact, ids = _run(lstm_onnx, tmp_path, cosine_min=0.9999999, op_types=["MatMul", "Gemm"])
    guard = artifact.info["guard"]
    assert guard["held"] and guard["excluded"] == ["/head/Gemm"] and guard["gave_up"] is None, guard
    assert "all 1 node(s) this pass converts are kept in float" in guard["unconverted"]
    assert not {"MatMulInteger", "DynamicQuantizeLinear"} & {n.op_type for n in artifact.load(with_weights=False).graph.node}
    np.testing.assert_allclose(run_model(artifact.path, ids)[0], run_model(model.path, ids)[0], atol=1e-5)
