"""PipeDream dynamic program for pipeline stages (in progress: registers nothing yet)."""
