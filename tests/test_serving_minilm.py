"""The repository `recipes/minilm-deploy.yaml` writes, in a real tritonserver: the real all-MiniLM-L6-v2.

This Triton (pytriton's) has no onnxruntime backend, so the frontier's stages are served as the
python-backend models the Triton target writes with `backend: python` (`optpipe serve`'s
repository): the same model.onnx as the deploy repository's, the same dims and batching.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from optpipe.core.artifact import sha256_file
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe
from optpipe.serving.repository import write_serving_repository
from optpipe.serving.triton_server import TritonServer
from serving_fixtures import INSTALL, grpc_inputs, http_inputs, needs_triton, stage_outputs

pytestmark = [pytest.mark.slow, needs_triton()]
RECIPE = __import__("pathlib").Path(__file__).resolve().parents[1] / "recipes" / "minilm-deploy.yaml"
MAX_BATCH = 32  # the recipe's dims.batch.max


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("minilm-serve")
    recipe = load_recipe(RECIPE)
    recipe.evaluate = recipe.evaluate.model_copy(update={"eager_baseline": False, "warmup": 1, "iterations": 5, "batch_sizes": [1]})
    report = compile_recipe(recipe, RunOptions(output=run_dir))
    stage = report.pareto[0]
    repository, models = write_serving_repository(run_dir, [stage])
    with TritonServer(repository, INSTALL) as server:
        yield run_dir, report, stage, models[0].name, server


def test_the_served_model_is_the_deploy_repositorys(served):
    run_dir, report, stage, name, _ = served
    deployed = next(t for t in report.targets if t.kind == "triton" and t.stage == stage)
    assert deployed.details["platform"] == "onnxruntime_onnx"  # what a full Triton image loads
    assert sha256_file(run_dir / deployed.path / "1" / "model.onnx") == sha256_file(run_dir / "serving" / "repository" / name / "1" / "model.onnx")


def eval_feeds(run_dir, batch: int, sequence: int) -> dict[str, np.ndarray]:
    from optpipe.serving.run_server import evaluation_samples

    samples = evaluation_samples(run_dir)
    return {key: np.ascontiguousarray(value[:batch, :sequence]) for key, value in samples.items()}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_minilm_answers_as_the_stage_does(served, protocol):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    run_dir, _, stage, name, server = served
    client = httpclient.InferenceServerClient(server.http_url) if protocol == "http" else grpcclient.InferenceServerClient(server.grpc_url)
    metadata = client.get_model_metadata(name, as_json=True) if protocol == "grpc" else client.get_model_metadata(name)
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]] == [
        (n, "INT64", [-1, -1]) for n in ("input_ids", "attention_mask", "token_type_ids")]
    for batch, sequence in ((1, 8), (4, 24), (3, 64)):  # shapes inside the dims (sequence 8..256)
        feeds = eval_feeds(run_dir, batch, sequence)
        inputs = http_inputs(feeds) if protocol == "http" else grpc_inputs(feeds)
        got = client.infer(name, inputs).as_numpy("last_hidden_state")
        # Same ONNX Runtime session settings and batch: measured max |diff| 0 here.
        np.testing.assert_allclose(got, stage_outputs(run_dir, stage, feeds)["last_hidden_state"], atol=1e-4)
    client.close()


def test_minilm_requests_are_merged_and_out_of_dims_refused(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    run_dir, _, _, name, server = served
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = client.get_inference_statistics(name, as_json=True)["model_stats"][0]
    feeds = eval_feeds(run_dir, 1, 32)
    gate = threading.Barrier(12)

    failures = []

    def one() -> None:
        own = grpcclient.InferenceServerClient(server.grpc_url)
        gate.wait()
        try:
            own.infer(name, grpc_inputs(feeds))
        except Exception as exc:  # shown by the assertion below, not lost in the thread
            failures.append(repr(exc))
        own.close()

    threads = [threading.Thread(target=one) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    after = client.get_inference_statistics(name, as_json=True)["model_stats"][0]
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    assert not failures and inferences == 12 and executions < inferences, (failures, inferences, executions)  # merged
    too_many = {key: np.repeat(value, MAX_BATCH + 1, axis=0) for key, value in feeds.items()}
    with pytest.raises(InferenceServerException, match=f"batch-size must be <= {MAX_BATCH}"):
        client.infer(name, grpc_inputs(too_many))
    long = {key: np.repeat(value, 10, axis=1) for key, value in feeds.items()}  # sequence 320 > dims.sequence.max 256
    with pytest.raises(InferenceServerException, match="input 'input_ids' dim 1 is 320, outside 8..256"):
        client.infer(name, grpc_inputs(long))
    assert client.infer(name, grpc_inputs(feeds)).as_numpy("last_hidden_state").shape == (1, 32, 384)
    client.close()
