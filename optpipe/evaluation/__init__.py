"""Measuring a stage: accuracy against the reference, latency, memory, and where error comes from."""
