"""The Triton target's repository in a real tritonserver (pytriton's 2.51 binary, python backend).

One compile of a tiny CNN (export, simplify, OpenVINO IR) with `backend: python`, one server on
the repository it wrote, queried with tritonclient over HTTP and gRPC: metadata, readiness,
outputs against each stage's own, batch sizes inside the dims, the dynamic batcher's merges,
and bad requests (each refused with Triton's error while the server keeps serving).
"""
from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest
from google.protobuf import text_format

from optpipe.serving.triton_server import TritonServer
from serving_fixtures import INSTALL, MAX_BATCH, cnn_run, grpc_inputs, http_inputs, needs_triton, stage_outputs

pytestmark = needs_triton()

MODELS = {"simplify": "tiny_simplify", "ov": "tiny_ov"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir, report = cnn_run(tmp_path_factory)
    assert {(t.stage, t.status) for t in report.targets} == {("simplify", "ok"), ("ov", "ok")}, [t.reason for t in report.targets]
    return run_dir, report


@pytest.fixture(scope="module")
def server(run):
    run_dir, _ = run
    with TritonServer(run_dir / "targets" / "triton", INSTALL) as started:
        yield started
    assert started.process.returncode is not None  # stopped, not left behind


@pytest.fixture(scope="module")
def clients(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http, grpc = httpclient.InferenceServerClient(server.http_url), grpcclient.InferenceServerClient(server.grpc_url)
    yield {"http": http, "grpc": grpc}
    http.close()
    grpc.close()


def images(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"image": np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype(np.float32)}


def infer(clients, protocol: str, model: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    inputs = http_inputs(feeds) if protocol == "http" else grpc_inputs(feeds)
    return clients[protocol].infer(model, inputs).as_numpy("logits")


def test_configs_are_python_backend_models_triton_reads(run):
    from tritonclient.grpc import model_config_pb2 as pb

    run_dir, _ = run
    for stage, name in MODELS.items():
        folder = run_dir / "targets" / "triton" / name
        config = text_format.Parse((folder / "config.pbtxt").read_text(), pb.ModelConfig())
        assert config.backend == "python" and not config.platform and config.max_batch_size == MAX_BATCH
        assert config.parameters["runtime"].string_value == ("openvino" if stage == "ov" else "onnxruntime")
        assert config.parameters["threads"].string_value == "2"
        assert (folder / "1" / "model.py").is_file()
        assert (folder / "1" / config.parameters["model_file"].string_value).is_file()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_metadata_and_readiness(clients, protocol):
    client = clients[protocol]
    assert client.is_server_live() and client.is_server_ready()
    for name in MODELS.values():
        assert client.is_model_ready(name)
        metadata = client.get_model_metadata(name)
        if protocol == "grpc":
            from google.protobuf.json_format import MessageToDict

            metadata = MessageToDict(metadata, preserving_proto_field_name=True)
        assert metadata["platform"] == "python"
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]] == [("image", "FP32", [-1, 3, 16, 16])]
        assert [(t["name"], [int(d) for d in t["shape"]]) for t in metadata["outputs"]] == [("logits", [-1, 10])]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("stage", list(MODELS))
def test_outputs_equal_the_stages_own_on_evaluation_inputs(run, clients, protocol, stage):
    from optpipe.serving.run_server import evaluation_samples

    run_dir, _ = run
    samples = evaluation_samples(run_dir, run_dir.parent / "cache")
    for batch in (1, 3, MAX_BATCH):  # batch sizes inside the dims
        feeds = {"image": samples["image"][:batch]}
        expected = stage_outputs(run_dir, stage, feeds)["logits"]
        # Same runtime, same settings, same batch: measured bit-identical; 1e-5 leaves room for
        # OpenVINO's kernel choice per batch size.
        np.testing.assert_allclose(infer(clients, protocol, MODELS[stage], feeds), expected, rtol=1e-5, atol=1e-5)


def test_dynamic_batching_merges_concurrent_requests(server, clients):
    import tritonclient.grpc as grpcclient

    name = MODELS["simplify"]

    def counts():
        stats = clients["grpc"].get_inference_statistics(name, as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))

    before = counts()
    outputs, gate = {}, threading.Barrier(MAX_BATCH)

    def one(i: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        gate.wait()
        outputs[i] = client.infer(name, grpc_inputs(images(1, seed=i))).as_numpy("logits")
        client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(MAX_BATCH)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = counts()
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == MAX_BATCH and executions < inferences, (inferences, executions)
    # Each merged request still gets its own answer.
    for i in range(MAX_BATCH):
        np.testing.assert_allclose(outputs[i], infer(clients, "grpc", name, images(1, seed=i)), rtol=1e-5, atol=1e-5)


def still_serving(clients) -> None:
    assert clients["http"].is_server_ready()
    assert infer(clients, "grpc", MODELS["simplify"], images(2)).shape == (2, 10)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_batch_beyond_the_dims_is_refused_by_triton(clients, protocol):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=f"batch-size must be <= {MAX_BATCH}"):
        infer(clients, protocol, MODELS["simplify"], images(MAX_BATCH + 1))
    still_serving(clients)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_shape_outside_the_dims_is_refused(clients, protocol):
    from tritonclient.utils import InferenceServerException

    wrong = {"image": np.zeros((1, 3, 17, 16), np.float32)}
    with pytest.raises(InferenceServerException, match=r"unexpected shape for input 'image'.*\[-1,3,16,16\]"):
        infer(clients, protocol, MODELS["ov"], wrong)
    still_serving(clients)


def test_a_wrong_dtype_is_refused(clients):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=r"inference input 'image' data-type is 'FP64', but model 'tiny_simplify' expects 'FP32'"):
        infer(clients, "grpc", MODELS["simplify"], {"image": images(1)["image"].astype(np.float64)})
    still_serving(clients)


def test_a_missing_input_is_refused(clients):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=r"expected 1 inputs but got 0 inputs|expected 1 inputs"):
        clients["http"].infer(MODELS["simplify"], [])
    with pytest.raises(InferenceServerException, match="unexpected inference input 'pixels'"):
        infer(clients, "http", MODELS["simplify"], {"pixels": images(1)["image"]})
    still_serving(clients)


def test_an_oversized_request_is_refused(clients):
    from tritonclient.utils import InferenceServerException

    big = {"image": np.zeros((4096, 3, 16, 16), np.float32)}  # 12 MB, 512x the batch limit
    with pytest.raises(InferenceServerException, match=f"batch-size must be <= {MAX_BATCH}"):
        infer(clients, "http", MODELS["simplify"], big)
    still_serving(clients)


def test_a_client_that_disconnects_mid_request_leaves_the_server_serving(server, clients):
    host, port = server.http_url.split(":")
    body = json.dumps({"inputs": [{"name": "image", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": [0.0] * 768}]}).encode()
    for sent in (len(body) // 2, 0):  # half the body; only the headers
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(f"POST /v2/models/{MODELS['simplify']}/infer HTTP/1.1\r\nHost: {host}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:sent])
    # and one that sends it all but leaves before the answer
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(f"POST /v2/models/{MODELS['simplify']}/infer HTTP/1.1\r\nHost: {host}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    still_serving(clients)
    assert server.process.poll() is None
