"""16-bit bytes (CostModel(dtype_bytes=2)): every term that moves or touches an activation charges
2 bytes a value; parameters, gradients and optimizer state keep their fp32 master bytes; the
gradient collectives' dtype is the compute dtype unless ``reduce_dtype_bytes`` says otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement
from autoplace.cost.analytic import CostModel
from autoplace.sim import Simulator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from sim_helpers import MS, cluster, graph  # noqa: E402

HALF = CostModel(dtype_bytes=2)


def _memory_bound() -> tuple[OpGraph, Cluster]:
    # one elementwise op: no FLOPs, 1e9 B in, 1e9 B out, 1e8 B of parameters; 1e12 B/s at 0.7
    g = OpGraph.build(["x", "y"], ["add", "add"], [(0, 1)], edge_bytes=[1e9], out_bytes=[1e9, 1e9],
                      param_bytes=[0.0, 1e8], fwd_flops=[0.0, 0.0], bwd_flops=[0.0, 0.0], batch_size=8)
    dev = Device("cuda:0", "gpu", 1e12, 1e12, 64e9, peak_flops_tensor=8e12, launch_overhead_s=0.0)
    return g, Cluster.from_links([dev], lambda i, j: Link("l", 1e9, 0.0))


def test_roofline_memory_term_charges_16_bit_values() -> None:
    g, c = _memory_bound()
    f32, b32 = CostModel().roofline_times(g, c)
    f16, b16 = HALF.roofline_times(g, c)
    # y reads 1e9 (its input) + writes 1e9 + reads 1e8 of weights: 2.1e9 B / 0.7e12 B/s fp32; half in 16 bits
    assert f32[1, 0] == pytest.approx(2.1e9 / 0.7e12)
    assert f16[1, 0] == pytest.approx(2.1e9 / 2 / 0.7e12)
    assert b16[1, 0] == pytest.approx(b32[1, 0] / 2)
    # the optimizer updates fp32 master weights: unchanged
    assert np.array_equal(HALF.update_times(g, c), CostModel().update_times(g, c))


def test_grad_scale_and_the_dtype_rules() -> None:
    assert (CostModel().value_scale, HALF.value_scale) == (1.0, 0.5)
    assert HALF.grad_scale() == 0.5 and CostModel().grad_scale() == 1.0
    assert CostModel(dtype_bytes=2, reduce_dtype_bytes=4).grad_scale() == 1.0
    assert CostModel(reduce_dtype_bytes=2).grad_scale(1.0) == 0.5
    assert CostModel().grad_scale(0.5) == 0.5  # a bf16 stage reduces in bf16 (autoplace's runtime)
    with pytest.raises(ValueError, match="dtype_bytes is 3"):
        CostModel(dtype_bytes=3)
    with pytest.raises(ValueError, match="reduce_dtype_bytes is 8"):
        CostModel(reduce_dtype_bytes=8)
    cm = CostModel(dtype_bytes=2, reduce_dtype_bytes=4)
    assert CostModel.from_dict(cm.to_dict()) == cm and "reduce_dtype_bytes" not in CostModel().to_dict()


@pytest.mark.parametrize("mode", ["pipeline", "model"])
def test_transfers_between_devices_move_16_bit_activations(mode: str) -> None:
    # two ops (1 ms forward, 2 ms backward) on two devices, 1e8 B between them at 1e10 B/s: a
    # transfer is 10 ms in fp32 (forward activation and backward gradient), 5 ms in 16 bits.
    # Step fp32: F0 1, send 10, F1 1, B1 2, send back 10, B0 2 = 26 ms; 16 bits: 16 ms.
    g = graph(2, [(0, 1)], [1.0, 1.0], [2.0, 2.0], edge_bytes=[1e8])
    c = cluster(2, bandwidth=1e10)
    p = (Placement.pipeline(g, c, [0, 1], [0, 1], microbatches=1) if mode == "pipeline"
         else Placement.from_assignment(g, c, [0, 1]))
    assert autoplace.simulate(g, p, c).step_time_s == pytest.approx(26 * MS)
    assert autoplace.simulate(g, p, c, cost=HALF).step_time_s == pytest.approx(16 * MS)


def test_activation_memory_halves_and_parameters_keep_fp32_bytes() -> None:
    # plain sum (no memory facts): one device keeps parameters 4 x 1e8 (Adam) + activations 2e8
    g = graph(2, [(0, 1)], [1.0, 1.0], [2.0, 2.0], edge_bytes=[0.0], param_bytes=[1e8, 0.0], out_bytes=[1e8, 1e8])
    c = cluster(1)
    p = Placement.from_assignment(g, c, [0, 0])
    assert autoplace.simulate(g, p, c).peak_memory_bytes[0] == pytest.approx(4e8 + 2e8)
    assert autoplace.simulate(g, p, c, cost=HALF).peak_memory_bytes[0] == pytest.approx(4e8 + 1e8)


def test_traced_memory_facts_halve_saved_activations_only() -> None:
    torch = pytest.importorskip("torch")
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    g = autoplace.trace(m, (torch.randn(4096, 64),))  # activations (MBs) over parameters (0.5 MB)
    c = cluster(1)
    full, half = Simulator(g, c).memory, Simulator(g, c, HALF).memory
    assert full is not None and half is not None
    assert full.s_bytes.sum() > 0 and np.allclose(half.s_bytes, full.s_bytes / 2)
    assert np.allclose(half.grad, full.grad / 2)
    assert np.array_equal(half.params, full.params) and np.array_equal(half.trainable, full.trainable)
    # the peak moves by less than the activations' half: parameters, gradients and Adam's state stay
    p32 = full.model_parallel(np.zeros(g.num_nodes, dtype=np.int64))[0]
    p16 = half.model_parallel(np.zeros(g.num_nodes, dtype=np.int64))[0]
    assert p16 < p32 and p32 - p16 < float(full.s_bytes.sum())


def test_ddp_gradients_in_the_reduce_dtype() -> None:
    # one replicated stage on 2 devices, 1e8 B of parameters at 1e10 B/s: a ring all-reduce moves
    # 2 x 1/2 x 1e8 B = 10 ms in fp32, 5 ms with 16-bit gradients, 10 ms again when reducing in fp32
    g = graph(2, [(0, 1)], [1.0, 1.0], [2.0, 2.0], edge_bytes=[0.0], param_bytes=[1e8, 0.0])
    c = cluster(2, bandwidth=1e10)
    flush = Placement.pipeline(g, c, [0, 0], [[0, 1]], microbatches=1)
    order = Placement.pipeline(g, c, [0, 1], [[0, 1]], microbatches=2, schedule="interleaved-1f1b", virtual_stages=2)
    for p in (flush, order):  # the GPipe/1F1B path (.pipeline) and the order executor (.stage_cost)
        fp32 = autoplace.simulate(g, p, c)
        half = autoplace.simulate(g, p, c, cost=HALF)
        reduce32 = autoplace.simulate(g, p, c, cost=CostModel(dtype_bytes=2, reduce_dtype_bytes=4))
        assert (fp32.allreduce_s, half.allreduce_s, reduce32.allreduce_s) == (
            pytest.approx(10 * MS), pytest.approx(5 * MS), pytest.approx(10 * MS))
        assert fp32.step_time_s - half.step_time_s == pytest.approx(5 * MS)


def test_tensor_matmul_ceiling_uses_the_measured_bf16_matmul_fraction_on_tensor_cores_only() -> None:
    # a compute-bound matmul of 1e13 FLOPs on an A100 (312 TFLOPS bf16, 19.5 fp32): at 0.6 of peak by
    # default; with the ceiling, MAMF 271.2 of 312 (stas00/ml-engineering); fp32 and unknown kinds unchanged
    g = OpGraph.build(["a", "b"], ["Linear", "add"], [(0, 1)], edge_bytes=[1e6], out_bytes=[1e6, 1e6],
                      param_bytes=[1e6, 0.0], fwd_flops=[1e13, 1e13], bwd_flops=[2e13, 2e13], batch_size=8)
    # (the class constants: shape_efficiency=False; tests/cost/test_efficiency.py covers the shape model)
    c = Cluster.preset("8xA100-nvlink").subset([0])
    half = CostModel(dtype_bytes=2, shape_efficiency=False)
    ceil = CostModel(dtype_bytes=2, tensor_matmul_ceiling=True, shape_efficiency=False)
    assert half.roofline_times(g, c)[0][0, 0] == pytest.approx(1e13 / (312e12 * 0.6) + 10e-6)
    assert ceil.roofline_times(g, c)[0][0, 0] == pytest.approx(1e13 / 271.2e12 + 10e-6)
    assert ceil.roofline_times(g, c)[0][1, 0] == half.roofline_times(g, c)[0][1, 0]  # not a matmul
    fp32 = CostModel(tensor_matmul_ceiling=True).roofline_times(g, c)[0]
    assert np.array_equal(fp32, CostModel().roofline_times(g, c)[0])
    v100 = Cluster.preset("8xV100-nvlink").subset([0])
    assert np.array_equal(ceil.roofline_times(g, v100)[0], half.roofline_times(g, v100)[0])
    assert CostModel.from_dict(ceil.to_dict()) == ceil
