"""Online fine-tuning: the placement keeps improving while the user's training runs, from the
step times it really measures.

- :mod:`.tuner`: ``OnlineConfig``, ``OnlineTuner`` (timing, trial schedule, failures), the
  step hook of ``wrap(..., finetune="online")`` over the module's ``Tunable`` protocol;
- :mod:`.search`: the next candidate (policy samples screened in the calibrated simulator), PPO;
- :mod:`.policy`: the policies it samples from (EAGLE centred on the plan; pipeline cuts);
- :mod:`.calibrate`: per-device and link factors fitted to measured step times;
- :mod:`.state`: parameters, gradients and optimizer state following a re-placement;
- :mod:`.pipeline`: the same for pipeline stages under torchrun (re-splits move state between ranks);
- :mod:`.kinds`: tuning over plan kinds under torchrun (DDP, GPipe, 1F1B, micro-batches, cuts): the
  candidate set and the categorical policy PPO trains over it;
- :mod:`.wrap_kinds`: what ``wrap(..., finetune="online")`` tunes over under torchrun (the kinds'
  candidates from the starting plan, or the cuts only: ``OnlineConfig.kinds`` / ``candidates``).
"""

from __future__ import annotations

from .tuner import OnlineConfig, OnlineError, OnlineTuner, StepTimer, Tunable, check_optimizer, online_config

__all__ = ["OnlineConfig", "OnlineTuner", "OnlineError", "StepTimer", "Tunable", "check_optimizer", "online_config"]
