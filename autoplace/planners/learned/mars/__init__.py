"""Mars (Lan et al., ICPP 2021): ``planner`` (network, policy, registered planner), ``encoders`` (the GraphSAGE graph encoder), ``decoder`` (the placer's device state, compiled with numba)."""
