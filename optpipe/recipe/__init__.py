"""The recipe: the YAML schema and its model sources, error lines, search spaces, synthetic inputs and run paths resolved from it."""
