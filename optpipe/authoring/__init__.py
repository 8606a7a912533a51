"""Writing recipes: `optpipe init` makes a starting recipe from a model."""
