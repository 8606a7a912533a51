"""Protobuf text format for Triton's config.pbtxt: the pieces every written config shares.

Written by hand rather than through tritonclient's ModelConfig message: that would make grpcio and
tritonclient runtime dependencies for a few lines of text. The tests parse every written file with
tritonclient.grpc.model_config_pb2.ModelConfig."""
from __future__ import annotations

from typing import Any


def tensor_text(tensor: dict[str, Any]) -> str:
    dims = ", ".join(str(d) for d in tensor["dims"])
    reshape = "\n    reshape: { shape: [ ] }" if "reshape" in tensor else ""
    return f'  {{\n    name: {quoted(tensor["name"])}\n    data_type: {tensor["data_type"]}\n    dims: [ {dims} ]{reshape}\n  }}'


def quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
