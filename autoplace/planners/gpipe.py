"""GPipe-style uniform pipeline stages (in progress: registers nothing yet)."""
