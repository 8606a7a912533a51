"""Running stages safely: worker processes with time limits, interrupts, signals, the run folder."""
