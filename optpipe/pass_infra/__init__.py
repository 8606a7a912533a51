"""The pass contract (name, version, typed params, run) and the instruments around every stage."""
