"""``pipeline-rl``: ``planner`` (the registered planner), ``policy`` (the network), ``space`` (the
action space: every sample a valid replicated pipeline), ``search`` (the learning-free pipeline
search control), ``pretrain`` (imitation of that search over a corpus: the shipped weights) and
``expert`` (expert iteration: the policy proposes, the search polishes, the policy imitates)."""
