"""The algorithms people run today, each a function registered as a planner.

``by_hand`` (single, expert, accelerate, data-parallel), ``metis``, ``baechi`` (m-TOPO, m-ETF,
m-SCT), ``pipedream_dp`` (PipeDream's dynamic program), ``gpipe`` (uniform GPipe stages),
``fsdp`` (fsdp, fsdp+ac, torchtitan); ``split`` and ``schedules`` are shared helpers.
"""

PLANNER_MODULES = ("by_hand", "metis", "baechi", "pipedream_dp", "gpipe", "fsdp")
"""Imported first and in this order by the registry (the order of ``autoplace.planners()``)."""
