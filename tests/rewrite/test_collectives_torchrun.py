"""The collectives torch runs in one training step of a composed plan equal the simulator's.

Under ``torchrun`` (gloo, CPU, fp32), each plan runs through ``autoplace.wrap`` (collectives_child.py):
two warm-up steps, then one step counted under CommDebugMode (a subclass that also records each
collective's process group, bytes and caller). Per rank, the count of every (kind, process group)
equals :func:`autoplace.sim.collectives.step_collectives`'s for the same graph, cluster and plan.

Nothing is dropped silently: a collective the runtime runs is either compared, or named below as
runtime bookkeeping (:data:`RUNTIME_ONLY`, one float each, no training data), or as training
communication the simulator does not price (:data:`UNPRICED`: a finding, asserted present so that
pricing it shows up here), or as a count on which the simulator's model and the runtime disagree
(:data:`DISAGREE`, asserted different on some rank). Point-to-point sends and receives are
compared by bytes (:data:`P2P`). The table printed with ``-s`` shows every row.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import pipeline_workers as pw
from autoplace.sim.collectives import StepCollective, collective_counts

CHILD = Path(__file__).with_name("collectives_child.py")

FOUR = [
    {"id": "tp2_ddp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe"},
    {"id": "fsdp2_tp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "fsdp"},
    {"id": "i1f1b_recompute_dp2", "model": "gpt-qkv", "pp": 2, "v": 2, "schedule": "interleaved-1f1b",
     "recompute": True},
    {"id": "zbv_fsdp2", "model": "gpt-qkv", "pp": 2, "v": 2, "schedule": "zbv", "shard": "fsdp"},
    {"id": "bn_ddp", "model": "bn", "shard": "ddp"},
    {"id": "bn_fsdp", "model": "bn", "shard": "fsdp"},
    {"id": "bn_hsdp", "model": "bn", "shard": "hsdp"},
]
MORE = [  # PP2 x TP2 (its FSDP option has one replica to shard over); sequence parallelism; FSDP stages
    # of a pipeline (those that reshard after forward: test_rewrite_pipeline_reshard.py)
    {"id": "pp2_tp2", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "shard": "fsdp", "microbatches": 4},
    {"id": "tp2_sp_ddp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "sequence_parallel": True},
    {"id": "pp2_tp2_sp", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "sequence_parallel": True},
    {"id": "pp2_fsdp2_gpipe", "model": "gpt-qkv", "pp": 2, "schedule": "gpipe", "shard": "fsdp", "microbatches": 4},
    # op-level selective recompute with TP: the checkpointed blocks' forward all-reduces run again,
    # with sequence parallelism their reduce-scatters do not (saved), their all-gathers do
    {"id": "pp2_tp2_selective", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "recompute": "selective-op"},
    {"id": "tp2_sp_selective_ddp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe",
     "sequence_parallel": True, "recompute": "selective-op"},
]
# ZBV (and every schedule that splits the backward) with FSDP stages that reshard after forward lost
# weight gradients (3 reduce-scatters where 6 were due): the runtime's rules now refuse it
# (tests/rewrite/test_split_backward_reshard.py).
EIGHT = [
    {"id": "pp2_tp2_dp2", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2},
    {"id": "pp2_tp2_dp2_i1f1b", "model": "gpt-qkv", "pp": 2, "v": 2, "tp": 2, "schedule": "interleaved-1f1b",
     "microbatches": 2},
]

VOCAB = [  # the vocabulary split across stages: the embedding's all-reduce on the first stage's TP group, the
    # loss's three and the head's input gradient's on the last's; a tied table's gradient summed across them
    {"id": "pp2_tp2_llama", "model": "llama", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4},
    {"id": "pp2_tp2_tied", "model": "gpt-tied", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4},
    {"id": "zbv_tp2_tied", "model": "gpt-tied", "pp": 2, "v": 2, "tp": 2, "schedule": "zbv"},
    {"id": "zbh1_tp2_sp_llama", "model": "llama", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 4,
     "sequence_parallel": True},
    # the option off (vocab_parallel=False): none of the split's all-reduces, the tied table's whole gradient summed
    {"id": "pp2_tp2_tied_whole", "model": "gpt-tied", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4,
     "vocab_parallel": False},
    {"id": "pp2_tp2_llama_whole", "model": "llama", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4,
     "vocab_parallel": False},
]

RUNTIME_ONLY = {
    "rewrite/liveness.py:wait": "the gate at the start of every step (liveness): a 1-float all-reduce over every rank",
    "rewrite/runner.py:_batch_loss": "the step's loss averaged over the replicas for the caller (1 float)",
}
"""autoplace's caller -> why the simulator has no such collective: bookkeeping, not training data."""

UNPRICED = {
    "broadcast rewrite/loop.py:_run": "DDP's broadcast of buffers (BatchNorm's running statistics) before every "
                                         "forward (issued inside the loop runner's DDP call), one per dtype: the host cost model charges its CPU (ddp_s), the "
                                         "simulator no collective",
}
"""[kind ]caller (autoplace's or torch's) -> training communication the runtime runs and the simulator
misses: findings, asserted present in the cases that run them."""

DISAGREE: dict[str, dict[str, str]] = {}
"""case -> kind -> why the simulator's model and the runtime differ on it (findings); asserted to
differ on some rank, so a fix on either side shows up here."""

P2P = ("send and recv are compared by bytes (from, to), not by count: CommDebugMode does not count them "
       "(c10d.send/recv_ are not in its collective set; this harness records them), and the runtime sends one "
       "message per boundary tensor where the simulator has one per boundary and micro-batch")


def _load(tmp_path: Path, ranks: int, cases: list[dict]) -> dict[str, list[dict]]:
    pw.launch_cases(CHILD, tmp_path, ranks, cases, timeout=600)
    return {c["id"]: [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)] for c in cases}


def _named(e: dict, table: dict[str, str]) -> str | None:
    """The key of ``table`` naming event ``e``: ``"[kind ]caller prefix"``, matched on either caller."""
    for key in table:
        kind, _, caller = key.rpartition(" ")
        if (not kind or kind == e["kind"]) and any(c.startswith(caller) for c in e["origin"]):
            return key
    return None


def split(case: str, part: dict) -> tuple[Counter, Counter, Counter, Counter]:
    """(runtime, simulator, runtime-only callers, unpriced callers) of one rank's counted step:
    collectives counted by (kind, group), sends and receives summed in bytes by (kind, (from, to))."""
    runtime: Counter = Counter()
    only: Counter = Counter()
    unpriced: Counter = Counter()
    for e in part["steps"][-1]["events"]:
        if (k := _named(e, RUNTIME_ONLY)) is not None:
            assert e["bytes"] <= 8, (case, e)  # one float: bookkeeping, not training data
            only[k] += 1
        elif (k := _named(e, UNPRICED)) is not None:
            unpriced[k] += 1
        else:
            runtime[(e["kind"], tuple(e["ranks"]))] += e["bytes"] if e["kind"] in ("send", "recv") else 1
    model: Counter = Counter()
    for e in (StepCollective(**x) for x in part["sim"]):
        model[(e.kind, e.group)] += round(e.nbytes) if e.kind in ("send", "recv") else e.count
    return runtime, model, only, unpriced


def _check(got: dict[str, list[dict]]) -> None:
    for case, parts in got.items():
        print(table(case, parts))
        differ: set[str] = set()
        for rank, part in enumerate(parts):
            step = part["steps"][-1]
            # the harness sees every collective CommDebugMode counts
            assert sum(step["comm_counts"].values()) == sum(e["kind"] not in ("send", "recv") for e in step["events"])
            runtime, model, _, unpriced = split(case, part)
            for key in set(runtime) | set(model):
                if key[0] in DISAGREE.get(case, {}):
                    differ |= {key[0]} if runtime.pop(key, 0) != model.pop(key, 0) else set()
            assert runtime == model, (case, rank, dict(runtime), dict(model))
            if case.startswith("bn_"):  # the BatchNorm statistics are priced (sim.ddp.bn_sync_op_seconds) and compared
                assert model[("all_reduce", tuple(range(len(parts))))] > 0, (case, rank)
        assert differ == set(DISAGREE.get(case, {})), (case, "agree now: drop from DISAGREE",
                                                        set(DISAGREE.get(case, {})) - differ)


def table(case: str, parts: list[dict]) -> str:
    """Per rank and (kind, group): runtime and simulator counts (sends and receives: count/bytes)."""
    lines = [f"{case}: rank kind group runtime simulator note"]
    for rank, part in enumerate(parts):
        events = part["steps"][-1]["events"]
        rt: Counter = Counter()
        rb: Counter = Counter()
        for e in events:
            if not _named(e, RUNTIME_ONLY) and not _named(e, UNPRICED):
                rt[(e["kind"], tuple(e["ranks"]))] += 1
                rb[(e["kind"], tuple(e["ranks"]))] += e["bytes"]
        sims = [StepCollective(**x) for x in part["sim"]]
        sm = collective_counts(sims)
        sb = {(e.kind, e.group): round(e.nbytes) for e in sims}
        for key in sorted(set(rt) | set(sm)):
            p2p = key[0] in ("send", "recv")
            note = "DISAGREE" if key[0] in DISAGREE.get(case, {}) else ""
            r_, s_ = (f"{rt.get(key, 0)}/{rb.get(key, 0)}B", f"{sm.get(key, 0)}/{sb.get(key, 0)}B") if p2p else (
                rt.get(key, 0), sm.get(key, 0))
            lines.append(f"  {rank} {key[0]} {key[1]} {r_} {s_} {note}")
        for name, table_ in (("runtime only", RUNTIME_ONLY), ("unpriced", UNPRICED)):
            c = Counter((e["kind"], tuple(e["ranks"]), _named(e, table_)) for e in events if _named(e, table_))
            for (kind, grp, who), n in sorted(c.items()):
                lines.append(f"  {rank} {kind} {grp} {n} 0 {name}: {who}")
    return "\n".join(lines)


def test_collectives_of_composed_plans_on_4_processes_equal_the_simulators(tmp_path: Path) -> None:
    _check(_load(tmp_path, 4, FOUR))


@pytest.mark.slow
def test_collectives_of_more_plans_on_4_processes(tmp_path: Path) -> None:
    _check(_load(tmp_path, 4, MORE))


@pytest.mark.slow
def test_collectives_of_pp2_x_tp2_x_dp2_on_8_processes_equal_the_simulators(tmp_path: Path) -> None:
    _check(_load(tmp_path, 8, EIGHT))


@pytest.mark.slow
def test_collectives_of_a_vocabulary_split_across_stages_equal_the_simulators(tmp_path: Path) -> None:
    got = _load(tmp_path, 4, VOCAB)
    _check(got)
    for case, share in (("pp2_tp2_tied", 2), ("pp2_tp2_tied_whole", 1)):
        for r, part in enumerate(got[case]):  # the tied table's gradient: a TP rank's shard of it (the whole
            group = (r % 2, r % 2 + 2)  # table with the split off), summed across the first and last stages
            ran = [e["bytes"] for e in part["steps"][-1]["events"]
                   if e["kind"] == "all_reduce" and tuple(e["ranks"]) == group]
            [sim] = [StepCollective(**x) for x in part["sim"] if tuple(x["group"]) == group and x["kind"] == "all_reduce"]
            assert ran == [sim.nbytes] == [32 * 16 * 4 / share], (case, r, ran, sim)  # V x h fp32 over tp
    for whole, split_ in (("pp2_tp2_tied_whole", "pp2_tp2_tied"), ("pp2_tp2_llama_whole", "pp2_tp2_llama")):
        # per micro-batch (4) the split adds the embedding's all-reduce on the first stage's TP group, the loss's
        # three and the head's input gradient's on the last's; the option off runs none of them
        for r in range(4):
            tp_group = (2 * (r // 2), 2 * (r // 2) + 1)
            n = [sum(e["kind"] == "all_reduce" and tuple(e["ranks"]) == tp_group for e in got[c][r]["steps"][-1]["events"])
                 for c in (split_, whole)]
            assert n[0] - n[1] == (4 if r < 2 else 4 * 4), (whole, r, n)
