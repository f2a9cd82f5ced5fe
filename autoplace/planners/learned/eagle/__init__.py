"""EAGLE (Lan et al., IPDPS 2021): ``planner`` (the registered planner, PPO over grouper and placer) and ``network`` (the grouper, linking RNN and seq2seq placer)."""
