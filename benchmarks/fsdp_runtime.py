"""The cost of autoplace's sharded runtime against the same plan written by hand with
``fully_shard`` and ``checkpoint_wrapper``: CPU, gloo, 2 processes, measured side by side.

    python benchmarks/fsdp_runtime.py          # writes benchmarks/results/fsdp_runtime.{json,md}
    python benchmarks/fsdp_runtime.py --smoke  # one short round: checks it runs, writes nothing

Both sides train the same Llama-class model (4 blocks of width 256, batch 8 x 256 tokens) with
the same plan: FSDP over the 2 processes, one unit per block plus the embedding, the final norm
and the output projection, and (second pair) full activation checkpointing of the blocks. By
hand is torchtitan's composition: ``checkpoint_wrapper`` around each block, ``fully_shard`` on
each block, on the embedding, norm and output, then on the model. autoplace's side is
``build_sharded_runner`` on the traced model (units outlined into GraphModules, the same
``fully_shard`` calls). Each measured step is a forward, a backward and an SGD step, and the
batch loss all-reduced over the processes (the runner returns it on every rank; by hand does the
same); the two sides alternate in rounds (A B, B A, ...) so load on the machine falls on both.
Reported: the median of the per-round ratios (paired: both sides of a round saw the same load)
with their quartiles, the ratio of medians and the ratio of the fastest rounds. Before timing,
both sides' first-step losses must agree (the same computation). Run it on a quiet machine
(``os.getloadavg()`` is recorded before and after); ``--smoke`` runs one round and writes
nothing.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
ROUNDS, STEPS, WARMUP = 25, 2, 3
if "--smoke" in sys.argv or os.environ.get("AUTOPLACE_FSDP_RUNTIME_SMOKE"):
    ROUNDS, STEPS, WARMUP = 2, 1, 1
CONFIG = dict(small=True, batch_size=8, seq_len=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
              vocab_size=4096)


def child(out: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autoplace.zoo as zoo
    from autoplace import Cluster, Placement
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.fsdp import build_sharded_runner
    from autoplace.rewrite.runtime import init_distributed

    rank, world, _ = init_distributed(timeout_s=120)
    torch.set_num_threads(1)
    rows = {}
    for ac in (False, True):
        wl = zoo.build("llama", **CONFIG)
        by_hand = copy.deepcopy(wl.model)
        traced = trace_module(wl.model, wl.example_inputs)
        c = Cluster.from_devices(["cpu"] * world)
        # torchtitan's full AC checkpoints the blocks only: the same units on both sides
        blocks = [f"layers.{i}" for i in range(CONFIG["n_layers"])]
        plan = Placement.pipeline(traced.graph, c, np.zeros(traced.graph.num_nodes, dtype=int), [list(range(world))],
                                  microbatches=1, shard="fsdp", recompute=blocks if ac else False)
        runner = build_sharded_runner(traced, plan, c, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for i, layer in enumerate(list(by_hand.layers)):
            if ac:
                layer = checkpoint_wrapper(layer)
                by_hand.layers[i] = layer
            fully_shard(layer, mesh=mesh)
        for m in (by_hand.tok_embeddings, by_hand.norm, by_hand.output):
            fully_shard(m, mesh=mesh)
        fully_shard(by_hand, mesh=mesh)
        opt_a = torch.optim.SGD(runner.parameters(), lr=1e-3)
        opt_b = torch.optim.SGD(by_hand.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, CONFIG["vocab_size"], (8, CONFIG["seq_len"]), generator=gen)
        y = torch.randint(0, CONFIG["vocab_size"], (8, CONFIG["seq_len"]), generator=gen)
        share = slice(rank * 8 // world, (rank + 1) * 8 // world)

        def step_autoplace() -> None:
            runner.step(x, target=y)
            opt_a.step()
            opt_a.zero_grad()

        def step_hand() -> torch.Tensor:
            loss = wl.loss_fn(by_hand(x[share]), y[share])
            loss.backward()
            total = loss.detach().float()
            dist.all_reduce(total)  # the batch loss on every rank, as the runner returns it
            opt_b.step()
            opt_b.zero_grad()
            return total / world

        first_a, first_b = runner.step(x, target=y), step_hand()
        opt_a.step()
        opt_a.zero_grad()
        if not torch.allclose(first_a, first_b, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"ac={ac}: first-step losses differ (autoplace {float(first_a)}, by hand "
                             f"{float(first_b)}): the two sides do not run the same computation")

        def timed(fn) -> float:  # type: ignore[no-untyped-def]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                fn()
            dist.barrier()
            return (time.perf_counter() - t0) / STEPS

        for _ in range(WARMUP):
            step_autoplace()
            step_hand()
        a, b = [], []
        for r in range(ROUNDS):
            first, second = (step_autoplace, step_hand) if r % 2 == 0 else (step_hand, step_autoplace)
            t1, t2 = timed(first), timed(second)
            (a.append(t1), b.append(t2)) if r % 2 == 0 else (b.append(t1), a.append(t2))
        rows["fsdp+ac" if ac else "fsdp"] = dict(autoplace_s=a, by_hand_s=b, loadavg=list(os.getloadavg()))
    if rank == 0:
        (out / "runtime.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    from autoplace.rewrite.runtime import free_port

    with tempfile.TemporaryDirectory() as tmp:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               __file__, "--child", tmp]
        t0 = time.perf_counter()
        load_before = list(os.getloadavg())
        smoke = {"AUTOPLACE_FSDP_RUNTIME_SMOKE": "1"} if "--smoke" in sys.argv else {}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **smoke})
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        rows = json.loads(Path(tmp, "runtime.json").read_text())
    table = ["# autoplace's sharded runtime against the same plan by hand (CPU, gloo, 2 processes)", "",
             f"Written by `python benchmarks/fsdp_runtime.py` ({time.perf_counter() - t0:.0f} s). Llama-class model, "
             f"{CONFIG['n_layers']} blocks of width {CONFIG['dim']}, batch 8 x {CONFIG['seq_len']} tokens; "
             f"{ROUNDS} alternating rounds of {STEPS} steps (forward, backward, SGD step) after {WARMUP} warm-up steps.",
             f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
             + "; ".join(f"{k} {', '.join(f'{x:.2f}' for x in r['loadavg'])}" for k, r in rows.items())
             + ". The per-round ratio pairs the two sides of one round (same load); its median is the figure.",
             "", "| plan | autoplace (median s/step) | by hand (median s/step) | median per-round ratio (quartiles) "
             "| ratio of medians | ratio of fastest rounds | per-round ratio (min .. max) |",
             "|---|---|---|---|---|---|---|"]
    out = {}
    for plan, r in rows.items():
        a, b = statistics.median(r["autoplace_s"]), statistics.median(r["by_hand_s"])
        per = sorted(x / y for x, y in zip(r["autoplace_s"], r["by_hand_s"]))
        fastest = min(r["autoplace_s"]) / min(r["by_hand_s"])
        q = statistics.quantiles(per, n=4) if len(per) > 1 else [per[0]] * 3
        out[plan] = dict(**r, ratio=a / b, ratio_fastest=fastest, per_round=per, ratio_paired=q[1])
        table.append(f"| {plan} | {a:.4f} | {b:.4f} | {q[1]:.3f} ({q[0]:.3f} .. {q[2]:.3f}) | {a / b:.3f} | "
                     f"{fastest:.3f} | {per[0]:.3f} .. {per[-1]:.3f} |")
    if "--smoke" in sys.argv:
        print("\n".join(table))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fsdp_runtime.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "fsdp_runtime.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
    elif set(sys.argv[1:]) - {"--smoke"}:  # --help, or anything unknown: say what runs, run nothing
        print(__doc__)
        sys.exit(0 if set(sys.argv[1:]) <= {"--help", "-h", "--smoke"} else 2)
    else:
        main()
