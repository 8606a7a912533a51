"""Inputs from elsewhere: recipe paths and names, ONNX files, checkpoints, checks before a run."""
