"""The source model: loading what the recipe names (HF folder, factory, ONNX file) and naming its outputs."""
