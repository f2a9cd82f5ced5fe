"""Bad input a new user meets, each a clear error (the value, the rule, the fix), never a
traceback from deep inside numpy, json or torch."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import autoplace
from autoplace import AutoplaceError, Placement, PlacementError
from autoplace.api import WrapError
from autoplace.graph.pipedream import ProfileError, load_pipedream
from autoplace.graph.propagate import TraceError


def _node(i: str, desc: str, a: str = "1204224.0") -> str:
    return (f"{i} -- {desc} -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size={a}, "
            "parameter_size=0.0")


# ---- PipeDream profiles ------------------------------------------------------------------

@pytest.mark.parametrize("desc", ["Conv2d(a)", "Conv2d()", "Linear(10)", "LSTM(a, b)", "MaxPool2d(kernel_size=x)",
                                  "Conv2d(3, 64, kernel_size=(3, 3), groups=0)"])
def test_layer_description_without_its_arguments(tmp_path: Path, desc: str) -> None:
    path = tmp_path / "graph.txt"
    path.write_text("\n".join([_node("node1", "Input0"), _node("node2", desc), "\tnode1 -- node2"]) + "\n")
    with pytest.raises(ProfileError) as info:
        load_pipedream(path)
    msg = str(info.value)
    assert f"graph.txt:2: node 'node2' is described as {desc!r}" in msg  # the value, where
    assert "lacks the arguments its FLOPs are computed from" in msg       # the rule
    assert "as PyTorch prints the module, e.g. " in msg                   # the fix


def test_binary_profile_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "graph.bin"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ProfileError, match=r"graph\.bin is not a text file .*a PipeDream profile is the graph\.txt"):
        load_pipedream(path)


# ---- plan files and Placement values -----------------------------------------------------

def _plan_file(tmp_path: Path, body: object) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(body))
    return path


def test_plan_file_that_is_a_json_list(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match=r"plan\.json: the plan is a JSON list, not an object; .*Placement\.to_json"):
        Placement.from_json(_plan_file(tmp_path, [0, 1]))


def test_plan_without_mode(tmp_path: Path) -> None:
    body = {"format": "autoplace.Placement/1", "device_of_node": [0, 1]}
    with pytest.raises(PlacementError, match=r"the plan has no \"mode\"; it must be one of 'model', 'pipeline'"):
        Placement.from_json(_plan_file(tmp_path, body))
    pipe = {"format": "autoplace.Placement/1", "mode": "pipeline", "device_of_node": [0, 1]}
    with pytest.raises(PlacementError, match=r"the pipeline plan has no 'stage_of_node', 'stage_devices'"):
        Placement.from_json(_plan_file(tmp_path, pipe))


def test_binary_plan_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    with pytest.raises(PlacementError, match=r"plan\.json is not a text file"):
        Placement.from_json(path)


def test_device_names_in_device_of_node(tmp_path: Path) -> None:
    body = {"format": "autoplace.Placement/1", "mode": "model", "device_of_node": [0, "cuda:1"]}
    with pytest.raises(PlacementError, match=r"device_of_node\[1\] is 'cuda:1', a name; it must be an integer: the "
                                             r"index of a cluster device"):
        Placement.from_json(_plan_file(tmp_path, body))
    with pytest.raises(PlacementError, match=r"device_of_node\[2\] is None"):
        Placement("model", [0, 1, None])  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match=r"stage_devices\[1\]\[0\]|stage_devices\[1\]"):
        Placement("pipeline", np.zeros(2), stage_of_node=[0, 1], stage_devices=((0,), ("cpu",)))  # type: ignore[arg-type]
    assert Placement("model", [0.0, 1.0]).device_of_node.tolist() == [0, 1]  # whole floats are indices


def test_repr_of_an_invalid_placement_does_not_raise() -> None:
    text = repr(Placement("pipeline", np.zeros(3)))
    assert "without stage_of_node" in text and "Placement.pipeline" in text


# ---- planners, wrap, tracing ---------------------------------------------------------------

def test_unknown_planner(tmp_path: Path) -> None:
    g = autoplace.trace(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(AutoplaceError, match=r"no planner named 'm-eft'; registered planners: .*m-etf"):
        autoplace.plan(g, autoplace.Cluster.preset("2xV100-pcie"), planner="m-eft")


def test_model_on_the_meta_device_is_refused_before_planning() -> None:
    wl = autoplace.zoo.build("gpt2", small=True, device="meta")
    start = time.perf_counter()
    with pytest.raises(WrapError, match=r"weights are all on the meta device.*to_empty"):
        autoplace.wrap(wl.model, ["cpu", "cpu"], example_inputs=wl.example_inputs, progress=False)
    assert time.perf_counter() - start < 2.0  # refused up front, not after planning
    assert all(p.device.type == "meta" for p in wl.model.parameters())


def _tiny_wav2vec2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=37, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(cfg)  # defaults: mask_time_prob=0.05 (SpecAugment), layerdrop=0.1


def test_hugging_face_trace_failure_names_the_cause_and_the_config() -> None:
    """Wav2Vec2ForCTC in training mode: SpecAugment's numpy masks and LayerDrop's coin flips stop
    both tracers; the error names the model's own line (not the decorator around forward) and the
    config fields to turn off, and turning them off is enough."""
    model = _tiny_wav2vec2()
    x = torch.randn(2, 1600)
    with pytest.raises(TraceError) as info:
        autoplace.trace(model, (x,))
    msg = str(info.value)
    assert "generic.py" not in msg                                        # not the decorator's line
    assert "modeling_wav2vec2.py" in msg and "_compute_mask_indices" in msg  # the real cause
    assert "mask_time_prob=0.05" in msg and "layerdrop=0.1" in msg
    assert "model.config.mask_time_prob = 0.0" in msg and "model.config.layerdrop = 0.0" in msg
    model.config.mask_time_prob = 0.0
    model.config.layerdrop = 0.0
    assert autoplace.trace(model, (x,)).num_nodes > 10


# ---- plan options the hardware cannot run ------------------------------------------------

def test_bf16_on_devices_without_bf16_names_the_device_and_the_fix() -> None:
    """V100 tensor cores do fp16 only (issue 12's bad input: bf16 on a device that has none)."""
    wl = autoplace.zoo.build("llama", small=True, device="meta")
    g = autoplace.trace(wl.model, wl.example_inputs)
    stages = np.zeros(g.num_nodes, dtype=int)
    v100 = autoplace.Cluster.preset("4xV100-pcie")
    with pytest.raises(PlacementError, match=r"device 0 .*has no bf16 tensor cores.*use precision='fp32'"):
        Placement.pipeline(g, v100, stages, [[0, 1, 2, 3]], microbatches=1, shard="fsdp", precision="bf16")
    a100 = autoplace.Cluster.preset("4xA100-nvlink")
    Placement.pipeline(g, a100, stages, [[0, 1, 2, 3]], microbatches=1, shard="fsdp", precision="bf16").validate(g, a100)
