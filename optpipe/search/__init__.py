"""Search spaces over pass params: grid or Optuna, every trial an ordinary cached stage."""
