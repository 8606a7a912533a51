"""The plan of a compile: the stage DAG, the rules on pass order and data, and the checks of a recipe beyond its schema."""
