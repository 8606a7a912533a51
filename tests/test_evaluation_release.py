"""What an evaluation builds is gone when it returns (issue 20): the ORT session that timed a stage and
computed its outputs, and the torch model of a big source once no pass reads it. On BERT-base each held
session or model is 0.4-1 GB on every later stage's peak (docs/memory.md)."""
from __future__ import annotations

import weakref

import numpy as np
import onnx.parser

from optpipe.recipe.schema import DimRange, EvaluateSpec, InputSpec, ModelInputs, Tolerance


def _evaluator(tmp_path, monkeypatch, sessions: list):
    from optpipe.cache.store import StageCache
    from optpipe.calibration.dataset import SampleSet
    from optpipe.evaluation import evaluator as evaluator_module
    from optpipe.evaluation.evaluator import Evaluator

    real = evaluator_module.ort_session

    def recorded(*args, **kwargs):
        session = real(*args, **kwargs)
        sessions.append(weakref.ref(session))
        return session

    monkeypatch.setattr(evaluator_module, "ort_session", recorded)
    shapes = ModelInputs((InputSpec(name="x", dtype="float32", shape=["n", 4]),), {"n": DimRange(min=1, opt=2, max=8)})
    samples = SampleSet({"x": np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)}, key="k", cached=False)
    settings = EvaluateSpec(batch_sizes=[1, 4], iterations=3, warmup=1, threads=1, adaptive=False)
    return Evaluator(settings, shapes, StageCache(tmp_path / "cache"), lambda: samples, providers="cpu")


def _stage(tmp_path, name: str, op: str):
    from optpipe.core.artifact import save_model

    graph = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float[n, 4] x) => (float[n, 4] y) {{ y = {op}(x) }}""")
    return save_model(graph, tmp_path / name)


def test_the_stage_session_is_released_when_its_evaluation_returns(tmp_path, monkeypatch):
    sessions: list[weakref.ref] = []
    evaluator = _evaluator(tmp_path, monkeypatch, sessions)
    reference, candidate = _stage(tmp_path, "ref", "Relu"), _stage(tmp_path, "cand", "Abs")
    evaluator.set_reference("ref", reference.content_hash(), lambda: evaluator.onnx_outputs(reference))
    for artifact in (reference, candidate):
        accuracy, latency, _, cached = evaluator.evaluate_onnx(artifact, Tolerance())
        assert not cached and accuracy is not None and latency
        # No gc.collect() here: the session must go by reference count as the call returns (a cycle
        # would keep it until the next collection, under the next stage's peak).
        assert sessions and all(ref() is None for ref in sessions), f"{artifact.folder.name}: a session outlived its evaluation"
    assert len(sessions) == 2  # one session per stage: the reference's outputs come from its own timing session


def test_bert_base_weights_are_big_enough_to_be_released_and_minilm_s_are_not(tmp_path):
    """BERT-base (438 MB FP32) is dropped after its export; MiniLM (90 MB) stays (a reload would cost
    more than its memory): the threshold between them is what keeps the BERT-base compile under 3 GB."""
    from optpipe.execution.services import RELEASE_BYTES
    from optpipe.source.torch_weights import fp32_weight_bytes

    from optpipe.safety.recipe_loading import parse_recipe

    def weights(**config) -> int:
        recipe = parse_recipe({
            "name": "size", "model": {"hf_config": {"model_type": "bert", **config}},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["b", 8], "range": [0, 100]}],
            "dims": {"b": {"min": 1, "opt": 1, "max": 2}},
            "stages": {"export": {"pass": "export"}},
        }, base_dir=tmp_path)
        return fp32_weight_bytes(recipe.model_source())

    bert_base = weights()
    minilm = weights(num_hidden_layers=6, hidden_size=384, num_attention_heads=12, intermediate_size=1536)
    assert 400e6 < bert_base < 460e6 and 80e6 < minilm < 100e6
    assert minilm < RELEASE_BYTES <= bert_base
