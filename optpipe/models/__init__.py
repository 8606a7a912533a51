"""Models optpipe ships for its recipes (architectures only; weights are seeded random)."""
