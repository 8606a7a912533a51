"""What every layer shares: the model artifact, the errors a user can cause, the result types, inference sessions, and the signal-stack guard."""
