"""torchrun child: fsdp_child.py's cases with op-level selective recompute ("selective-op")."""

from __future__ import annotations

import fsdp_child

fsdp_child.CASES.update({
    "fsdp-sac": (1, dict(shard="fsdp", recompute="selective-op"), 2, 1),
    "pp-fsdp-sac": (2, dict(shard="fsdp", recompute="selective-op"), 2, 1),
    "gpt2-fsdp-sac": (1, dict(shard="fsdp", recompute="selective-op"), 2, 1),
})

if __name__ == "__main__":
    fsdp_child.main()
