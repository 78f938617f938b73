"""Where N ranks should run (gpucoll topo --suggest, gpucoll run --bind), on the saved real
outputs: GPUs that make the best ring, the CPUs of each GPU's NUMA node, its nearest NICs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_topology_readers import FakeNvml, build_sysfs, recorded

from gpucoll.topology import load, probe
from gpucoll.topology.layout import (
    choose_gpus,
    format_cpulist,
    parse_cpulist,
    place,
    suggest,
    visible_indices,
)
from gpucoll.topology.render import main
from gpucoll.topology.smi import parse_smi

DATA = Path(__file__).parent / "data" / "topology"
SAVED = sorted(DATA.glob("*.txt"))


def saved(stem: str):
    return load(next(DATA.glob(stem + "*.txt")))


def _cases():
    out = []
    for path in SAVED:
        gpus = len(load(path).gpus)
        out += [pytest.param(path, n, id=f"{path.stem[:24]}-{n}") for n in range(1, gpus + 1)]
    return out


@pytest.mark.parametrize("path,n", _cases())
def test_every_rank_gets_its_own_gpu_with_that_gpus_cpus_and_nearest_nics(path, n):
    layout = load(path)
    places, notes = suggest(layout, n)
    assert notes == [] and [p.rank for p in places] == list(range(n))
    assert len({p.gpu for p in places}) == n
    for p in places:
        gpu = layout.gpus[p.gpu]
        assert p.cpus == gpu.cpu_affinity
        nearest = layout.nearest_nic.get(gpu.name, ([], None))[0]
        devices = {d.name: d.device for d in layout.nics}
        assert set(p.nics) <= {devices[name] for name in nearest}


def test_on_a_dgx_a100_ranks_pair_up_on_their_numa_nodes_and_pcie_switch_nics():
    places, _ = suggest(saved("dgx-a100"), 4)
    assert [p.gpu for p in places] == [0, 1, 2, 3]
    assert [p.numa for p in places] == ["3", "3", "1", "1"]
    assert places[0].nccl_env() == {"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}
    assert places[3].nccl_env() == {"NCCL_IB_HCA": "=mlx5_2,mlx5_3"}
    assert places[2].describe() == ("GPU2, CPUs 16-31,144-159 (NUMA 1), NICs mlx5_2, mlx5_3 "
                                    "(PXB)")


def test_on_an_hgx_h200_each_gpu_gets_its_own_pix_nic_and_its_numa_nodes_cpus():
    places, _ = suggest(saved("hgx-h200"), 8)
    assert [p.nics for p in places] == [(f"mlx5_{i}",) for i in (0, 3, 4, 5, 6, 7, 8, 9)]
    assert places[0].cpus is None and places[0].numa == "0"  # blank affinity: the node's CPUs
    assert places[0].describe().startswith("GPU0, the CPUs of NUMA node 0")


def test_the_gpu_across_the_socket_is_left_out_when_fewer_ranks_fit():
    assert choose_gpus(saved("pcie-5gpu"), 4) == [1, 2, 3, 4]
    assert sorted(choose_gpus(saved("pcie-5gpu"), 2)) in ([1, 2], [3, 4])  # a PHB pair


def test_a_dgx1_ring_of_four_keeps_to_one_socket_on_nvlink():
    order = choose_gpus(saved("dgx1"), 4)
    layout = saved("dgx1")
    hops = [layout.matrix[f"GPU{a}"][f"GPU{b}"] for a, b in zip(order, order[1:] + order[:1],
                                                                    strict=True)]
    assert all(h.startswith("NV") for h in hops) and sorted(order) == [0, 1, 2, 3]


def test_no_nic_is_exported_where_every_nic_is_as_far_as_the_nearest():
    layout = saved("a100-8gpu-nv12-3nic-4socket")
    gpu4 = place(layout, [4])[0]  # all three NICs across the sockets (SYS)
    assert gpu4.nics == () and gpu4.nccl_env() == {}
    assert place(layout, [0])[0].nccl_env() == {"NCCL_IB_HCA": "=mlx5_0"}
    assert place(saved("dgx1"), [0])[0].nics == ()  # the machine's only NIC: no choice to make


def test_a_probed_machine_also_names_the_network_interfaces(tmp_path):
    layout = probe(nvml=FakeNvml(recorded("dgx-a100")),
                   sysfs_root=build_sysfs(tmp_path, "dgx-a100"))
    env = place(layout, [5])[0].nccl_env()
    assert env == {"NCCL_IB_HCA": "=mlx5_4,mlx5_5", "NCCL_SOCKET_IFNAME": "=ib4,ib5"}


def test_more_ranks_than_gpus_share_them_round_robin_and_say_so():
    places, notes = suggest(saved("rtx-a6000"), 5)
    assert [p.gpu for p in places] == [0, 1, 2, 0, 1]
    assert notes == ["5 ranks share 3 GPU(s) (NCCL needs one GPU per rank): rank r uses the "
                     "GPU of rank r mod 3"]


def test_many_gpus_choose_the_best_arc_of_the_whole_ring():
    names = [f"GPU{i}" for i in range(16)]
    rows = []
    for a in range(16):  # two NVLink islands of 8, joined by PCIe
        cells = ["X" if a == b else "NV4" if a // 8 == b // 8 else "SYS" for b in range(16)]
        rows.append(f"GPU{a}\t" + "\t".join(cells))
    layout = load_text("\t" + "\t".join(names) + "\n" + "\n".join(rows) + "\n")
    assert sorted(choose_gpus(layout, 8)) in (list(range(8)), list(range(8, 16)))


def load_text(text: str):
    from gpucoll.topology.layout import analyze
    from gpucoll.topology.smi import observed_from_smi

    return analyze(observed_from_smi(parse_smi(text)))


def test_visible_devices_by_index_or_uuid_map_to_topology_gpus(tmp_path):
    layout = probe(nvml=FakeNvml(recorded("dgx-a100")),
                   sysfs_root=build_sysfs(tmp_path, "dgx-a100"))
    uuid = layout.gpus[6].uuid
    assert visible_indices(layout, ["3", uuid, "MIG-1234", "9"]) == [3, 6, None, None]


def test_a_gpu_the_topology_lacks_is_named():
    with pytest.raises(ValueError, match=r"GPUs \[7\] are not in the topology"):
        place(saved("gtx1080ti"), [0, 7])


@pytest.mark.parametrize("text,cpus", [("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}),
                                       ("", set()), ("0-1,\n", {0, 1})])
def test_cpulists_read_and_write_the_linux_way(text, cpus):
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("text", ["0-x", "3-1", "-2", "a"])
def test_a_malformed_cpulist_is_refused_naming_the_part(text):
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpulist(text)


def test_topo_suggest_prints_the_order_cpus_nics_and_the_command(capsys):
    assert main(["--from", str(next(DATA.glob("dgx-a100*.txt"))), "--suggest", "2"]) == 0
    out = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=0,1" in out
    assert "rank 1: GPU1, CPUs 48-63,176-191 (NUMA 3), NICs mlx5_0, mlx5_1 (PXB); " \
           "NCCL_IB_HCA==mlx5_0,mlx5_1" in out
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1 gpucoll run -n 2 --bind" in out


def test_topo_suggest_as_json(capsys):
    assert main(["--from", str(next(DATA.glob("hgx-h200*.txt"))), "--suggest", "3",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cuda_visible_devices"] == "0,1,2" and doc["notes"] == []
    assert doc["placements"][1]["env"] == {"NCCL_IB_HCA": "=mlx5_3"}


@pytest.mark.parametrize("argv", [["--suggest", "0"], ["--suggest", "2", "--dot"]])
def test_topo_suggest_refuses_nonsense(argv, capsys):
    assert main(["--from", str(SAVED[0]), *argv]) == 2
    assert "--suggest" in capsys.readouterr().err
