"""The `model.py` of the text ensemble's two python-backend steps (Triton param `text_ensemble`).

Copied as is into `<name>_tokenizer/1/model.py` and `<name>_pooling/1/model.py`; the config's
`step` parameter says which one it is. It runs in Triton's Python environment, not optpipe's.
- tokenizer: strings in, the model's token inputs out, through the model's own tokenizer.json in
  Hugging Face's `tokenizers` library (the Rust tokenizer `transformers` wraps); truncated to the
  recipe's sequence max, padded to the longest string of the request and at least the sequence min.
- pooling: the model's token states and the attention mask in, one vector per string out: the
  mean over the tokens the mask keeps (sentence-transformers' mean pooling), or the first token.
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.inputs = [tensor["name"] for tensor in config["input"]]
        self.outputs = [(tensor["name"], pb_utils.triton_string_to_numpy(tensor["data_type"])) for tensor in config["output"]]
        if self.params["step"] == "tokenizer":
            from tokenizers import Tokenizer

            folder = os.path.join(args["model_repository"], args["model_version"])
            self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
            self.tokenizer.enable_truncation(max_length=int(self.params["max_length"]))
            self.tokenizer.no_padding()  # padded below: to the request's longest string, and at least min_length
            self.min_length = int(self.params["min_length"])

    def execute(self, requests):
        step = self._tokenize if self.params["step"] == "tokenizer" else self._pool
        responses = []
        for request in requests:
            try:
                outputs = step(request)
            except Exception as exc:  # the library's own message, to this request's client
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.params['step']}: {type(exc).__name__}: {exc}")))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, np.ascontiguousarray(outputs[name].astype(dtype, copy=False))) for name, dtype in self.outputs]))
        return responses

    def _tokenize(self, request):
        texts = pb_utils.get_input_tensor_by_name(request, self.inputs[0]).as_numpy().reshape(-1)
        strings = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts]
        encodings = self.tokenizer.encode_batch(strings)
        length = max(self.min_length, max(len(e.ids) for e in encodings))
        pad = int(self.params["pad_id"])

        def padded(rows, fill):
            return np.array([row + [fill] * (length - len(row)) for row in rows], dtype=np.int64)

        arrays = {
            "input_ids": padded([e.ids for e in encodings], pad),
            "attention_mask": padded([e.attention_mask for e in encodings], 0),
            "token_type_ids": padded([e.type_ids for e in encodings], 0),
        }
        return {name: arrays[name] for name, _ in self.outputs}

    def _pool(self, request):
        states = pb_utils.get_input_tensor_by_name(request, self.inputs[0]).as_numpy().astype(np.float32)
        if self.params["pooling"] == "cls":
            return {self.outputs[0][0]: states[:, 0]}
        mask = pb_utils.get_input_tensor_by_name(request, self.inputs[1]).as_numpy().astype(np.float32)[..., None]
        return {self.outputs[0][0]: (states * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)}
