"""The roofline CostModel against numbers worked out by hand from the V100 datasheet figures
(15.7 TFLOP/s fp32, 125 TFLOP/s tensor, 900 GB/s, 10 us launch overhead per op)."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace import Cluster, CostModel, OpGraph

PEAK, TENSOR, BW, OVH = 15.7e12, 125e12, 900e9, 10e-6


def v100(n: int = 1) -> Cluster:
    return Cluster.homogeneous("V100-16GB", n, "nvlink2")


def chain() -> OpGraph:
    """conv (compute bound) -> relu (memory bound) -> tiny (overhead bound) -> idle (nothing)."""
    return OpGraph.build(
        ["conv", "relu", "tiny", "idle"],
        ["Conv2d", "ReLU", "Add", "View"],
        [(0, 1), (1, 2)],
        out_bytes=[1e6, 4e8, 4.0, 0.0],
        param_bytes=[2e6, 0.0, 0.0, 0.0],
        fwd_flops=[1e12, 1e6, 1.0, 0.0],
        bwd_flops=[2e12, 1e6, 1.0, 0.0],
    )


def test_compute_bound_op() -> None:
    fwd, bwd = CostModel().op_times(chain(), v100())
    # conv: 1e12 FLOP at 55% of 15.7 TFLOP/s = 0.11581 s; its 3e6 bytes take 4.8 us at 70% of 900 GB/s.
    assert fwd[0, 0] == pytest.approx(1e12 / (PEAK * 0.55) + OVH, rel=1e-12)
    assert fwd[0, 0] == pytest.approx(0.115818, rel=1e-5)
    assert bwd[0, 0] == pytest.approx(2e12 / (PEAK * 0.55) + OVH, rel=1e-12)


def test_memory_bound_op() -> None:
    fwd, bwd = CostModel().op_times(chain(), v100())
    # relu reads 1e6 bytes (conv's output) and writes 4e8: 4.01e8 bytes at 630 GB/s = 636.5 us.
    assert fwd[1, 0] == pytest.approx(4.01e8 / (BW * 0.7) + OVH, rel=1e-12)
    assert fwd[1, 0] == pytest.approx(646.51e-6, rel=1e-4)
    # Backward moves twice the activations: 8.02e8 bytes.
    assert bwd[1, 0] == pytest.approx(8.02e8 / (BW * 0.7) + OVH, rel=1e-12)


def test_overhead_and_idle_ops() -> None:
    fwd, bwd = CostModel().op_times(chain(), v100())
    # "tiny" reads 4e8 bytes from relu: memory bound too, plus the overhead.
    assert fwd[2, 0] == pytest.approx((4e8 + 4) / (BW * 0.7) + OVH)
    # "idle" computes, stores and owns nothing: it costs nothing, not even the overhead.
    assert fwd[3, 0] == 0.0 and bwd[3, 0] == 0.0
    lone = OpGraph.build(["a"], ["Add"], [], out_bytes=[4.0], fwd_flops=[1.0], bwd_flops=[1.0])
    f, _ = CostModel(overhead_scale=3.0).op_times(lone, v100())
    assert f[0, 0] == pytest.approx(3 * OVH + 4.0 / (BW * 0.7), rel=1e-9)


def test_every_device_column_and_efficiency_classes() -> None:
    fwd, _ = CostModel().op_times(chain(), v100(4))
    assert fwd.shape == (4, 4)
    assert np.all(fwd == fwd[:, :1])
    cm = CostModel().with_efficiency(conv=0.25)
    f2, _ = cm.op_times(chain(), v100())
    assert f2[0, 0] == pytest.approx(1e12 / (PEAK * 0.25) + OVH)
    # A kind with no class of its own uses "other".
    g = OpGraph.build(["x"], ["frobnicate"], [], out_bytes=[4.0], fwd_flops=[1e12], bwd_flops=[0.0])
    f3, _ = CostModel(compute_efficiency={"other": 0.5}).op_times(g, v100())
    assert f3[0, 0] == pytest.approx(1e12 / (PEAK * 0.5) + OVH)


def test_tensor_cores_for_half_precision() -> None:
    fwd, _ = CostModel(dtype_bytes=2).op_times(chain(), v100())
    assert fwd[0, 0] == pytest.approx(1e12 / (TENSOR * 0.55) + OVH)


def test_batch_fraction_scales_work_not_parameters_or_overhead() -> None:
    g = OpGraph.build(["fc"], ["Linear"], [], out_bytes=[4e8], param_bytes=[6.3e8], fwd_flops=[1e9], bwd_flops=[2e9])
    fwd, bwd = CostModel().op_times(g, v100(), batch_fraction=0.25)
    # Bytes: all 6.3e8 parameter bytes + a quarter of 4e8 output bytes = 7.3e8 at 630 GB/s.
    assert fwd[0, 0] == pytest.approx(7.3e8 / (BW * 0.7) + OVH)
    assert bwd[0, 0] == pytest.approx(2 * 7.3e8 / (BW * 0.7) + OVH)
    # Compute bound case: a quarter of the FLOPs.
    fwd_c, _ = CostModel().op_times(chain(), v100(), batch_fraction=0.25)
    assert fwd_c[0, 0] == pytest.approx(0.25e12 / (PEAK * 0.55) + OVH)


def measured() -> OpGraph:
    return chain().with_times([0.2, 1e-3, 2e-5, 0.0], [0.4, 2e-3, 2e-5, 0.0], profiled_on="V100-16GB")


def test_measured_times_used_on_their_kind() -> None:
    fwd, bwd = CostModel().op_times(measured(), Cluster.preset("8xV100-nvlink"))
    assert fwd.shape == (4, 8)
    assert np.allclose(fwd, np.array([0.2, 1e-3, 2e-5, 0.0])[:, None])
    assert np.allclose(bwd, np.array([0.4, 2e-3, 2e-5, 0.0])[:, None])
    # use_measured=False: the roofline, as if no one had measured.
    f0, _ = CostModel(use_measured=False).op_times(measured(), v100())
    assert f0[0, 0] == pytest.approx(1e12 / (PEAK * 0.55) + OVH)


def test_time_factor_scales_roofline_and_measured_times_alike() -> None:
    """A calibrated Device.time_factor multiplies that device's op and update times, whether the
    times come from the roofline or from a profile of the same kind (where peak FLOP/s plays no part)."""
    from dataclasses import replace

    from autoplace.online.calibrate import scaled_cluster

    c = Cluster.preset("2xV100-pcie")
    slow = scaled_cluster(c, {c.devices[0].name: 3.0}, 1.0)   # device 0 three times slower
    assert slow.time_factors.tolist() == [3.0, 1.0]
    for g in (chain(), chain().with_times([0.2, 1e-3, 2e-5, 0.0], [0.4, 2e-3, 2e-5, 0.0],
                                            profiled_on="V100-PCIe-16GB")):
        f0, b0 = CostModel().op_times(g, c)
        f1, b1 = CostModel().op_times(g, slow)
        assert np.allclose(f1[:, 0], 3.0 * f0[:, 0]) and np.allclose(b1[:, 0], 3.0 * b0[:, 0])
        assert np.array_equal(f1[:, 1], f0[:, 1])
        u0, u1 = CostModel().update_times(g, c), CostModel().update_times(g, slow)
        assert np.allclose(u1[:, 0], 3.0 * u0[:, 0]) and np.array_equal(u1[:, 1], u0[:, 1])
    # An uncalibrated device keeps its cluster's fingerprint; a calibrated one round-trips.
    assert replace(c, devices=tuple(replace(d, time_factor=1.0) for d in c.devices)).fingerprint == c.fingerprint
    assert Cluster.from_dict(slow.to_dict()) == slow and slow.fingerprint != c.fingerprint


def test_measured_times_scaled_by_fp32_peak_on_other_kinds() -> None:
    c = Cluster.preset("2xA100+2xT4")
    fwd, _ = CostModel().op_times(measured(), c)
    # A100: 19.5 TFLOP/s fp32, T4: 8.1; measured on a 15.7 TFLOP/s V100.
    assert fwd[0].tolist() == pytest.approx([0.2 * 15.7 / 19.5] * 2 + [0.2 * 15.7 / 8.1] * 2)
    # Same family, other variant: V100 PCIe (14 TFLOP/s).
    fp, _ = CostModel().op_times(measured(), Cluster.preset("2xV100-pcie"))
    assert fp[0, 0] == pytest.approx(0.2 * 15.7 / 14.0)


def test_measured_times_partial_and_unknown_kind() -> None:
    g = chain().with_times([0.2, np.nan, 2e-5, 0.0], [0.4, np.nan, 2e-5, 0.0], profiled_on="V100-16GB")
    fwd, _ = CostModel().op_times(g, v100())
    assert fwd[0, 0] == 0.2
    assert fwd[1, 0] == pytest.approx(4.01e8 / (BW * 0.7) + OVH)  # not measured: the roofline
    # Measured on a kind the cluster does not know how to relate to: the roofline everywhere.
    h = chain().with_times([0.2, 1e-3, 2e-5, 0.0], [0.4, 2e-3, 2e-5, 0.0], profiled_on="mystery-gpu")
    fh, _ = CostModel().op_times(h, v100())
    assert fh[0, 0] == pytest.approx(1e12 / (PEAK * 0.55) + OVH)
    # Measured somewhere unnamed: the numbers are taken as they are.
    u = chain().with_times([0.2, 1e-3, 2e-5, 0.0], [0.4, 2e-3, 2e-5, 0.0], profiled_on="")
    fu, _ = CostModel().op_times(u, v100())
    assert fu[0, 0] == 0.2


def test_measured_times_at_a_micro_batch() -> None:
    fwd, _ = CostModel().op_times(measured(), v100(), batch_fraction=0.5)
    # Scaled like the roofline: conv is compute bound, so (0.5 * t_c + ovh) / (t_c + ovh).
    tc = 1e12 / (PEAK * 0.55)
    assert fwd[0, 0] == pytest.approx(0.2 * (0.5 * tc + OVH) / (tc + OVH))


def test_update_times() -> None:
    g = chain()
    up = CostModel().update_times(g, v100(2))
    # Adam reads p, g, m, v and writes p, m, v: 7 bytes per parameter byte at 630 GB/s.
    assert up[0].tolist() == pytest.approx([2e6 * 7 / (BW * 0.7)] * 2)
    assert np.all(up[1:] == 0.0)
    sgd = CostModel(optimizer="sgd").update_times(g, v100())
    assert sgd[0, 0] == pytest.approx(2e6 * 3 / (BW * 0.7))
    assert CostModel().optimizer_state_factor == 2.0
    assert CostModel(optimizer="sgd-momentum").optimizer_state_factor == 1.0


def test_bad_settings_and_round_trip() -> None:
    with pytest.raises(ValueError, match="optimizer 'lamb'"):
        CostModel(optimizer="lamb")
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        CostModel(compute_efficiency={"conv": 1.5})
    with pytest.raises(ValueError, match="memory_efficiency"):
        CostModel(memory_efficiency=0.0)
    with pytest.raises(ValueError, match="unknown kind classes"):
        CostModel().with_efficiency(convolution=0.5)
    cm = CostModel(memory_efficiency=0.5, calibration={"fitted_on": ["x"]}).with_efficiency(conv=0.3)
    assert CostModel.from_dict(cm.to_dict()) == cm
