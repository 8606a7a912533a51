"""ONNX graph facts and edits: op statistics, node surgery, channel groups, weight sparsity."""
