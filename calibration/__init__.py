"""Data for evaluation and calibration: sources, the content-addressed sample cache, readers."""
