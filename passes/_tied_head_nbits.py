"""A tied LM head quantized to MatMulNBits from the embedding table's rows, a slice of the vocabulary at a time.

A tied head multiplies by Transpose(table) (optpipe/graph/matmul_weights.py). ORT's MatMulNBitsQuantizer takes
only a MatMul whose weight is an initializer, so the head used to get the transposed table as a float
initializer of its own first: on Gemma 3 270M (a 0.67 GB table) that copy and the quantizer's reads of it took
the weight_only pass to 3.4 GB, 3.2x the model's FP32 weights (issue 20). No library quantizes a weight it is
handed in slices, so this part is written here, around ORT's own block quantizer:

- MatMulNBits quantizes B [K, N] in blocks along K, each column N on its own; column n of the head is row n of
  the table. A slice of rows, transposed, is a slice of columns, quantized exactly as the whole would be
  (`DefaultWeightOnlyQuantizer.qbits_block_quant`, the call ORT's quantizer makes on the whole weight).
- The rows are read a slice at a time: from the file where the table is still external data (the pass's worker
  reads the weights from disk, passes/_weight_only_on_disk.py), else from the loaded tensor.
- The node and its initializers are named and laid out as ORT's quantizer writes them for the transposed copy
  (`quantize_matmul`, QOperator form); tests/test_weight_only_on_disk.py compares the two tensor for tensor.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from optpipe.graph.matmul_weights import drop_unread_transposes
from optpipe.safety.onnx_guard import external_bytes

#: Table bytes per slice: small beside the table (Gemma's is 0.67 GB), large enough for the C++ kernel's threads.
SLICE_BYTES = 32 << 20

#: The table dtypes quantized in slices (what ORT's kernels take as they are); others go through the float copy.
STREAMED_DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def quantize_tied_heads(model: onnx.ModelProto, heads: list, config, folder: Path) -> None:
    """Replace each head (MatMul, Transpose, table) of `model` by MatMulNBits, in place; `config`: ORT's
    DefaultWeightOnlyQuantConfig (QOperator form); `folder`: where the table's external data lives, if it does."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    quantizer = DefaultWeightOnlyQuantizer(config)
    graph = model.graph
    done: dict[str, list[str]] = {}  # table -> the quantized weight's input names, one copy per table
    for node, transpose, table in heads:
        if table.name not in done:
            weight_name = f"{table.name}/transposed"  # the name matmul_weights gives the float copy
            tensors = _quantized(quantizer, table, folder, weight_name, config)
            graph.initializer.extend(tensors)
            done[table.name] = [t.name for t in tensors]
        kwargs = {"K": table.dims[1], "N": table.dims[0], "bits": config.bits, "block_size": config.block_size}
        if config.accuracy_level:
            kwargs["accuracy_level"] = config.accuracy_level
        replacement = helper.make_node("MatMulNBits", [node.input[0], *done[table.name]], [node.output[0]],
                                       name=f"{node.name}_Q{config.bits}" if node.name else "", domain="com.microsoft", **kwargs)
        node.CopyFrom(replacement)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    drop_unread_transposes(graph, {transpose.output[0] for _, transpose, _ in heads})


def _quantized(quantizer, table: onnx.TensorProto, folder: Path, name: str, config) -> list[onnx.TensorProto]:
    """Packed weights, scales (and, asymmetric, zero points) of Transpose(table), as ORT's quantize_matmul names them."""
    import onnx_ir as ir

    vocab = table.dims[0]
    packed = scales = zero_points = None
    for start, rows in _row_slices(table, folder):
        p, s, z = quantizer.qbits_block_quant(np.ascontiguousarray(rows.T))
        if packed is None:  # the per-column shapes come from the first slice
            packed = np.empty((vocab, *p.shape[1:]), p.dtype)
            scales = np.empty((vocab, *s.shape[1:]), s.dtype)
            zero_points = np.empty((vocab, *z.shape[1:]), z.dtype)
        stop = start + len(rows)
        packed[start:stop], scales[start:stop], zero_points[start:stop] = p, s, z
    tensors = [ir.serde.serialize_tensor(ir.Tensor(packed, name=f"{name}_Q{config.bits}")),
               ir.serde.serialize_tensor(ir.Tensor(scales, name=f"{name}_scales"))]
    if not config.is_symmetric:
        tensors.append(numpy_helper.from_array(zero_points, f"{name}_zero_points"))
    return tensors


def _row_slices(table: onnx.TensorProto, folder: Path) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of the table, SLICE_BYTES at a time: read from its external data file, else from memory."""
    dtype = helper.tensor_dtype_to_np_dtype(table.data_type)
    vocab, hidden = table.dims
    step = max(1, SLICE_BYTES // (hidden * dtype.itemsize))
    if not external_data_helper.uses_external_data(table):
        whole = numpy_helper.to_array(table)
        for start in range(0, vocab, step):
            yield start, whole[start:start + step]
        return
    path, offset, _ = external_bytes(table, folder)
    for start in range(0, vocab, step):
        count = min(step, vocab - start)
        rows = np.fromfile(path, dtype, count=count * hidden, offset=offset + start * hidden * dtype.itemsize)
        yield start, rows.reshape(count, hidden)
