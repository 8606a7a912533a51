"""The int8 guard's re-quantizations reuse the first try's calibration (ORT's calibration cache).

Excluding a node changes which tensors get Q/DQ, not the float ranges measured on the float
model, so every try after the first must load the cached ranges instead of recalibrating,
and give the same model as a fresh calibration with the same exclusions.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

import optpipe.passes.int8 as int8
from test_int8 import OUTLIER, case, run_int8


def counting_reader(monkeypatch) -> dict:
    """Counts readers made and batches served through the pass's own reader factory."""
    counts = {"readers": 0, "batches": 0}
    make = int8.ort_calibration_reader

    def counted(*args, **kwargs):
        reader = make(*args, **kwargs)
        counts["readers"] += 1
        get_next = reader.get_next

        def next_batch():
            batch = get_next()
            counts["batches"] += batch is not None
            return batch

        reader.get_next = next_batch
        return reader

    monkeypatch.setattr(int8, "ort_calibration_reader", counted)
    return counts


def graph_of(model: onnx.ModelProto) -> tuple:
    nodes = [(n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node]
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return nodes, inits


def test_guard_tries_calibrate_once_and_match_a_fresh_calibration(tmp_path, monkeypatch):
    source, recipe, arrays = case(tmp_path, OUTLIER, outlier=True)
    counts = counting_reader(monkeypatch)
    guarded = run_int8(source, recipe, arrays, tmp_path / "a" / "out", mode="static", calibration_batch=8)
    assert guarded.info["quantizations"] >= 2 and guarded.info["excluded"] == ["mm1"]  # the guard re-quantized
    # One reader, one pass over the 32 samples in batches of 8, for all the tries together.
    assert counts == {"readers": 1, "batches": 4}
    assert not guarded.info["calibration"]["cached"]

    # A fresh calibration (another cache) with the guard's final exclusion gives the same model.
    fresh = run_int8(source, recipe, arrays, tmp_path / "b" / "out", mode="static", calibration_batch=8,
                     exclude=["mm1"], guard=False)
    assert counts == {"readers": 2, "batches": 8}
    (nodes, inits), (fresh_nodes, fresh_inits) = graph_of(guarded.load()), graph_of(fresh.load())
    assert nodes == fresh_nodes and inits.keys() == fresh_inits.keys()
    for name, value in inits.items():
        np.testing.assert_array_equal(value, fresh_inits[name], err_msg=name)
