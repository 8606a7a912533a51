"""Facts about the CPU the compile runs on: its vector width, and the features that change kernels and numerics."""
