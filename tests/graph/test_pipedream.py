"""load_pipedream: the eight published profiles against independent counts of their lines, and
small hand-written profiles for the format's corners and for every kind of bad input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Cluster
from autoplace.graph.pipedream import ProfileError, load_pipedream

# Batch sizes worked out by hand from each file's Input (or LSTM hidden state) line:
# alexnet 154140672 / (3*224*224*4) = 256; vgg16 77070336 / 602112 = 128; inception_v3
# 137319936 / (3*299*299*4) = 128; nasnetalarge 9633792 / 602112 = 16; gnmt's LSTM hidden
# state 131072 / (1024*4) = 32.
BATCH = {"alexnet": 256, "vgg16": 128, "resnet18": 256, "resnet50": 128, "resnext50": 128,
         "inception_v3": 128, "nasnetalarge": 16, "gnmt": 32}


def _independent_counts(path: Path) -> tuple[int, int, float, float, set[tuple[str, str]]]:
    """Nodes, edges, summed forward ms (Input lines excepted) and backward ms, read plainly."""
    nodes = edges = 0
    fwd = bwd = 0.0
    pairs: set[tuple[str, str]] = set()
    for line in path.read_text().splitlines():
        if line.startswith("\t"):
            edges += 1
            a, b = line.strip().split(" -- ")
            pairs.add((a, b))
        elif line.strip():
            nodes += 1
            desc = line.split(" -- ")[1]
            f = float(line.split("forward_compute_time=")[1].split(",")[0])
            b_ = float(line.split("backward_compute_time=")[1].split(",")[0])
            if not desc.startswith("Input"):
                fwd += f
            bwd += b_
    return nodes, edges, fwd, bwd, pairs


def test_profile_matches_its_file(pipedream_profile: Path) -> None:
    g = load_pipedream(pipedream_profile)
    nodes, edges, fwd_ms, bwd_ms, pairs = _independent_counts(pipedream_profile)
    assert g.num_nodes == nodes
    assert g.num_edges == edges
    assert math.isclose(g.fwd_time_s.sum(), fwd_ms / 1e3, rel_tol=1e-9)
    assert math.isclose(g.bwd_time_s.sum(), bwd_ms / 1e3, rel_tol=1e-9)
    # Every edge of the file is in the graph, and goes forward (topological order).
    got = {(g.names[s], g.names[d]) for s, d in g.edges.tolist()}
    assert got == pairs
    assert np.all(g.edges[:, 0] < g.edges[:, 1])
    assert g.batch_size == BATCH[pipedream_profile.stem]
    assert g.profiled_on == "V100-16GB"
    assert g.has_measured_times
    assert set(g.kinds) & {"Input"} == {"Input"}
    for i in np.nonzero(np.array(g.kinds) == "Input")[0]:
        assert g.fwd_time_s[i] == 0.0
        assert g.names[i] in g.meta["input_load_time_s"]


def test_flops_match_published_counts(pipedream_profile: Path) -> None:
    # Published forward cost per 224x224 image: ResNet-50 4.1 GMAC, VGG-16 15.5 GMAC, AlexNet
    # 0.72 GMAC, ResNet-18 1.8 GMAC, Inception-V3 (299x299) 5.7 GMAC; 1 MAC = 2 FLOPs.
    published_gmac = {"resnet50": 4.1, "vgg16": 15.5, "alexnet": 0.72, "resnet18": 1.8, "inception_v3": 5.7}
    name = pipedream_profile.stem
    if name not in published_gmac:
        pytest.skip("no published count used for this model")
    g = load_pipedream(pipedream_profile)
    per_image = g.fwd_flops.sum() / g.batch_size / 2e9
    assert per_image == pytest.approx(published_gmac[name], rel=0.05)


def test_gnmt_multi_outputs_and_getitem_edges(pipedream_profile: Path) -> None:
    if pipedream_profile.stem != "gnmt":
        pytest.skip("GNMT only")
    g = load_pipedream(pipedream_profile)
    i = g.index
    # node7 is LSTM(2048, 1024) with outputs [6291456; 131072; 131072].
    assert g.out_bytes[i["node7"]] == 6291456 + 2 * 131072
    eb = {(g.names[s], g.names[d]): b for (s, d), b in zip(g.edges.tolist(), g.edge_bytes)}
    assert eb[("node7", "node8")] == 6291456  # __getitem__(0)
    assert eb[("node7", "node9")] == 131072  # __getitem__(1)
    assert eb[("node23", "node27")] == 6160384  # __getitem__(3) of RecurrentAttention
    assert eb[("node6", "node7")] == 12582912  # a plain edge carries the whole output
    assert g.kinds[i["node1"]] == "Input" and g.kinds[i["node23"]] == "RecurrentAttention"
    assert g.meta["descriptions"][i["node6"]] == "Dropout(p=0.2)"
    # LSTM(2048, 1024) over 32 x 48 tokens: 2 * 4 * 1024 * (2048 + 1024) FLOPs per token.
    assert g.fwd_flops[i["node7"]] == 2 * 4 * 1024 * 3072 * 32 * 48
    assert g.bwd_flops[i["node7"]] == 2 * g.fwd_flops[i["node7"]]


# ---- small hand-written profiles ----------------------------------------------------------


def _line(node: str, desc: str, f: str = "1.0", b: str = "2.0", a: str = "400.0", p: str = "0.0") -> str:
    return (f"{node} -- {desc} -- forward_compute_time={f}, backward_compute_time={b}, "
            f"activation_size={a}, parameter_size={p}")


def _write(tmp_path: Path, lines: list[str], name: str = "p.txt") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_small_profile_sorted_converted_and_estimated(tmp_path: Path) -> None:
    # 2 images of 3x224x224 fp32 = 1204224 bytes; the file lists nodes out of order.
    lines = [
        _line("node3", "ReLU(inplace)", f="0.5", b="0.25", a="800.0"),
        _line("node10", "Linear(in_features=4, out_features=5, bias=True)", f="2.0", b="3.0", a="40.0", p="100.0"),
        _line("node1", "Input", f="473.0", b="0.0", a="1204224.0"),
        _line("node2", "Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), groups=1, bias=False)",
              f="1.5", b="4.0", a="800.0", p="432.0"),
        "\tnode3 -- node10",
        "\tnode1 -- node2",
        "\tnode2 -- node3",
    ]
    g = load_pipedream(_write(tmp_path, lines))
    assert g.names == ("node1", "node2", "node3", "node10")
    assert g.kinds == ("Input", "Conv2d", "ReLU", "Linear")
    assert g.batch_size == 2
    assert g.fwd_time_s.tolist() == [0.0, 1.5e-3, 0.5e-3, 2.0e-3]
    assert g.bwd_time_s.tolist() == [0.0, 4.0e-3, 0.25e-3, 3.0e-3]
    assert g.meta["input_load_time_s"] == {"node1": 0.473}
    assert g.edges.tolist() == [[0, 1], [1, 2], [2, 3]]
    assert g.edge_bytes.tolist() == [1204224.0, 800.0, 800.0]
    # Conv: 800 bytes = 200 outputs, each 3 channels x 3x3 taps x 2 FLOPs.
    assert g.fwd_flops[1] == 200 * 3 * 9 * 2
    assert g.bwd_flops[1] == 2 * g.fwd_flops[1]
    # ReLU: one per output element, backward once more (no weights).
    assert g.fwd_flops[2] == 200 and g.bwd_flops[2] == 200
    # Linear: 40 bytes = 10 outputs (2 rows x 5), each 4 multiply-adds.
    assert g.fwd_flops[3] == 10 * 4 * 2
    assert g.param_bytes.tolist() == [0.0, 432.0, 0.0, 100.0]
    assert autoplace.load_pipedream is load_pipedream


def test_in_place_layers_add_no_activation(tmp_path: Path) -> None:
    # ReLU(inplace) and Add(inplace) write into their input: the simulator charges them no
    # activation memory (the VGG-16 and ResNet profiles' in-place ReLUs were charged as new
    # activations); their output still counts as bytes written and sent.
    lines = [_line("node1", "Input", a="1204224.0"),
             _line("node2", "Conv2d(3, 4, kernel_size=(1, 1), stride=(1, 1))", a="800.0", p="48.0"),
             _line("node3", "ReLU(inplace)", a="800.0"), _line("node4", "ReLU()", a="800.0"),
             _line("node5", "Add(inplace)", a="800.0"),
             "\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node4", "\tnode4 -- node5", "\tnode2 -- node5"]
    g = load_pipedream(_write(tmp_path, lines))
    assert g.out_bytes.tolist() == [1204224.0, 800.0, 800.0, 800.0, 800.0]
    assert g.meta["in_place"] == ["node3", "node5"]
    assert g.edge_bytes.tolist() == [1204224.0, 800.0, 800.0, 800.0, 800.0]
    c = Cluster.from_devices(["cpu"])
    r = autoplace.simulate(g, autoplace.Placement.from_assignment(g, c, [0] * 5), c)
    assert r.peak_memory_bytes[0] == pytest.approx(4 * 48.0 + 1204224.0 + 800.0 + 800.0)  # Adam: 4 x params


def test_ties_broken_by_node_number_and_grouped_conv(tmp_path: Path) -> None:
    lines = [
        _line("node1", "Input", a="1204224.0"),
        _line("node10", "Conv2d(4, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), groups=4, bias=False)",
              a="1600.0", p="288.0"),
        _line("node2", "MaxPool2d(kernel_size=3, stride=2, padding=1, dilation=1, ceil_mode=False)", a="80.0"),
        _line("node9", "Add", a="80.0"),
        "\tnode1 -- node10",
        "\tnode1 -- node2",
        "\tnode2 -- node9",
        "\tnode10 -- node9",
    ]
    g = load_pipedream(_write(tmp_path, lines))
    assert g.names == ("node1", "node2", "node10", "node9")
    i = g.index
    assert g.fwd_flops[i["node10"]] == 400 * (4 / 4) * 9 * 2  # groups=4: one input channel per output
    assert g.fwd_flops[i["node2"]] == 20 * 9  # 3x3 window per output element
    assert g.fwd_flops[i["node9"]] == 20


def test_multi_output_edge_bytes(tmp_path: Path) -> None:
    lines = [
        _line("node1", "Input0", a="0.0"),
        _line("node2", "LSTM(8, 4)", a="[96.0; 32.0; 32.0]", p="100.0"),
        _line("node3", "__getitem__(1)", a="32.0"),
        _line("node4", "Dropout(p=0.2)", a="128.0"),
        "\tnode1 -- node2",
        "\tnode2 -- node3",
        "\tnode2 -- node4",
    ]
    g = load_pipedream(_write(tmp_path, lines))  # LSTM hidden 32 bytes = 2 x 4 fp32: batch 2
    assert g.batch_size == 2
    assert g.out_bytes[1] == 160.0
    assert g.edge_bytes.tolist() == [0.0, 32.0, 160.0]
    # 96 bytes = 24 values = 6 tokens x 4 hidden; each 2 * 4*4 * (8 + 4) FLOPs.
    assert g.fwd_flops[1] == 6 * 2 * 16 * 12


def test_batch_size_from_argument_and_contradiction(tmp_path: Path) -> None:
    lines = [_line("node1", "Input", a="12.0"), _line("node2", "Linear(in_features=3, out_features=2)", a="8.0"),
             "\tnode1 -- node2"]
    path = _write(tmp_path, lines)
    with pytest.raises(ProfileError, match="batch_size"):
        load_pipedream(path)
    assert load_pipedream(path, batch_size=1).batch_size == 1
    image = _write(tmp_path, [_line("node1", "Input", a="1204224.0")], "img.txt")
    with pytest.raises(ProfileError, match=r"batch_size=3 contradicts .* say 2"):
        load_pipedream(image, batch_size=3)
    with pytest.raises(ProfileError, match="profiled_on"):
        load_pipedream(image, profiled_on="V99")


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        ([_line("node1", "Input", a="1204224.0"), "node2 -> Conv2d"],
         r"p\.txt:2: cannot parse .*expected a node line"),
        ([_line("node1", "Input", a="1204224.0"), _line("node2", "ReLU", f="-1.0")],
         r"p\.txt:2: forward_compute_time of node 'node2' is -1\.0"),
        ([_line("node1", "Input", a="1204224.0"), _line("node2", "ReLU", b="nan")],
         r"p\.txt:2: backward_compute_time of node 'node2' is nan"),
        ([_line("node1", "Input", a="1204224.0"), _line("node2", "ReLU", a="[4.0; -2.0]")],
         r"activation_size\[1\] of node 'node2' is -2\.0"),
        ([_line("node1", "Input", a="1204224.0"), _line("node2", "ReLU", p="x")],
         r"parameter_size of node 'node2' is 'x', not a number"),
        ([_line("node1", "Input", a="1204224.0"), "\tnode1 -- node7"],
         r"p\.txt:2: edge node1 -> node7 names node 'node7'"),
        ([_line("node1", "Input", a="1204224.0"), _line("node2", "ReLU"), _line("node3", "ReLU"),
          "\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node2"],
         r"cycle: node2 -> node3 -> node2|cycle: node3 -> node2 -> node3"),
        ([_line("node1", "Input", a="1204224.0"), _line("node1", "ReLU")], r"p\.txt:2: node 'node1' is defined again"),
        ([_line("node1", "Input", a="1204224.0"), _line("node2", "ReLU"), "\tnode1 -- node2", "\tnode1 -- node2"],
         r"p\.txt:4: edge node1 -> node2 repeats line 3"),
        (["\tnode1 -- node2"], r"no node lines"),
    ],
)
def test_bad_profiles_name_file_line_and_value(tmp_path: Path, lines: list[str], pattern: str) -> None:
    path = _write(tmp_path, lines)
    with pytest.raises(ProfileError, match=pattern):
        load_pipedream(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_pipedream(tmp_path / "absent.txt")
