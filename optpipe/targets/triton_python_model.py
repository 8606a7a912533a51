"""The `model.py` of a Triton python-backend model that optpipe writes (Triton param `backend: python`).

This file is copied as is into `<repo>/<model>/1/model.py` and runs inside Triton's python-backend
stub, in the Python environment Triton was started with (not optpipe's: it imports nothing of
optpipe). It runs the same artifact the other configs name (`model.onnx` in ONNX Runtime, or
`model.xml` in OpenVINO) with the session settings the stage was measured with, which
config.pbtxt carries as parameters.

Why by hand: Triton's python backend hands `execute` a list of requests (the dynamic batcher's
merge) but leaves joining them to the model; the ONNX Runtime and OpenVINO backends do that
join in C++. Requests whose non-batch shapes agree are concatenated on the batch dim and run
as one call, then split back, which is what those backends do.
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.batched = config.get("max_batch_size", 0) > 0
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.outputs = [(tensor["name"], pb_utils.triton_string_to_numpy(tensor["data_type"])) for tensor in config["output"]]
        threads = int(params.get("threads", "1"))
        # (input, axis, min, max, dim name): the recipe's ranges, the shapes this model was measured on
        self.ranges = [(name, int(axis), int(low), int(high), dim) for name, axis, low, high, dim in
                       (entry.split(",") for entry in params.get("dim_ranges", "").split(";") if entry)]
        if params.get("runtime") == "openvino":
            self.run = self._openvino(os.path.join(folder, params.get("model_file", "model.xml")), threads, params.get("hint", "f32"))
        else:
            self.run = self._onnxruntime(os.path.join(folder, params.get("model_file", "model.onnx")), threads)

    def _onnxruntime(self, path, threads):
        import onnxruntime as ort

        # The settings optpipe measured the stage with (optpipe.core.runtime.session_options).
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        names = [name for name, _ in self.outputs]

        def run(feeds):
            return dict(zip(names, session.run(names, feeds)))

        return run

    def _openvino(self, path, threads, hint):
        # `import openvino` sends a telemetry event (processes, ~/intel/stats) unless the environment says CI:
        # the switch optpipe sets around its own OpenVINO calls (openvino_runtime.telemetry_off); a served
        # model sends none either. Set for this stub process only, which runs nothing that reads CI.
        os.environ.setdefault("CI", "true")
        import openvino as ov

        # optpipe.evaluation.openvino_runtime.compile_config: one latency stream, the measured hint.
        compiled = ov.Core().compile_model(path, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": hint,
        })
        request = compiled.create_infer_request()
        ports = {name: compiled.output(index) for index, (name, _) in enumerate(self.outputs)}

        def run(feeds):
            results = request.infer(feeds)
            return {name: np.array(results[port]) for name, port in ports.items()}

        return run

    def execute(self, requests):
        feeds = [{name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names}
                 for request in requests]
        responses = [None] * len(requests)
        for index, feed in enumerate(feeds):
            refusal = self._outside_ranges(feed)
            if refusal:
                responses[index] = pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal))
        for group in self._groups([i for i, response in enumerate(responses) if response is None], feeds):
            try:
                outputs = self._run_group([feeds[i] for i in group])
            except Exception as exc:  # the runtime's own message, to the client of each request in the group
                for i in group:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}"))
                continue
            for i, result in zip(group, outputs):
                tensors = [pb_utils.Tensor(name, np.ascontiguousarray(result[name].astype(dtype, copy=False))) for name, dtype in self.outputs]
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
        return responses

    def _outside_ranges(self, feed):
        for name, axis, low, high, dim in self.ranges:
            size = feed[name].shape[axis] if axis < feed[name].ndim else None
            if size is not None and not low <= size <= high:
                return (f"input '{name}' dim {axis} is {size}, outside {low}..{high} (the recipe's dims.{dim}), "
                        "the shapes this model was measured on")
        return None

    def _groups(self, indices, feeds):
        """Request indices by their inputs' non-batch shapes: only those can share one run."""
        groups = {}
        for index in indices:
            feed = feeds[index]
            key = tuple((name, feed[name].shape[1:] if self.batched else feed[name].shape, feed[name].dtype.str) for name in self.input_names)
            groups.setdefault(key, []).append(index)
        return list(groups.values())

    def _run_group(self, feeds):
        if len(feeds) == 1 or not self.batched:
            return [self.run(feed) for feed in feeds]
        sizes = [len(feed[self.input_names[0]]) for feed in feeds]
        joined = self.run({name: np.concatenate([feed[name] for feed in feeds]) for name in self.input_names})
        bounds = np.cumsum(sizes)[:-1]
        parts = {name: np.split(value, bounds) for name, value in joined.items()}
        return [{name: parts[name][i] for name in parts} for i in range(len(feeds))]
