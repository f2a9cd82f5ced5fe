"""``pipeline-rl``: ``planner`` (the registered planner), ``policy`` (the network), ``space`` (the action space: every sample a valid replicated pipeline)."""
