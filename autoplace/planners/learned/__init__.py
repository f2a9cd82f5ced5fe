"""Learned planners and the machinery they share.

``env`` (the placement environment: candidates, rewards, heuristic seeds), ``ppo`` (the PPO
update and training loop), ``refine`` (local search that polishes a policy's best),
``run`` (a learned planner's budget and report), ``adam``, ``seq2seq``, ``corpus`` and
``pretrain`` (pretraining over graphs and clusters); one subpackage per policy: ``eagle/``
(grouper + placer, IPDPS'21), ``mars/`` (GNN encoder + segment placer, ICPP'21), ``pipeline/``
(the pipeline/hybrid planner), and ``reinforce`` (Mirhoseini et al.'s hierarchical planner).
"""

PLANNER_MODULES = ("eagle.planner", "mars.planner", "pipeline.planner", "reinforce")
"""Imported first and in this order by the registry."""
