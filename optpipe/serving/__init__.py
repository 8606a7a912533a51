"""Serving what optpipe compiled: a real Triton server on a run's stages, `optpipe serve`, and its load test."""
