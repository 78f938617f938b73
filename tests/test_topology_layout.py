"""What the layout concludes from the real saved nvidia-smi outputs."""

from pathlib import Path

import pytest

from gpucoll.topology import load, ring_order
from gpucoll.topology.layout import MAX_NVLINKS_PER_GPU, best_ring, ring_key

DATA = Path(__file__).parent / "data" / "topology"


def layout_of(stem: str):
    return load(next(DATA.glob(stem + "*.txt")))


def codes(layout) -> dict[str, list]:
    out: dict[str, list] = {}
    for w in layout.warnings:
        out.setdefault(w.code, []).append(w)
    return out


def test_matrix_keeps_labels_as_printed_and_is_symmetric():
    layout = layout_of("dgx1")
    assert layout.matrix["GPU0"]["GPU3"] == "NV2"
    assert layout.matrix["GPU0"]["GPU5"] == "SYS"
    assert layout.matrix["mlx5_0"]["GPU2"] == "PIX"
    for a, row in layout.matrix.items():
        assert row[a] == "X"
        for b, label in row.items():
            assert layout.matrix[b][a] == label


def test_dgx1_hybrid_cube_mesh_counts_links_without_nvswitch():
    layout = layout_of("dgx1")
    assert len(layout.nvlink_pairs) == 16
    assert sorted(layout.nvlink_pairs.values()).count(2) == 8
    assert layout.islands == [[f"GPU{i}" for i in range(8)]]
    assert layout.nvswitch is False


def test_dgx1_ring_uses_only_double_nvlinks():
    layout = layout_of("dgx1")
    assert ring_order(layout) == [0, 3, 2, 1, 5, 6, 7, 4]
    order = layout.ring_order
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        assert layout.matrix[f"GPU{a}"][f"GPU{b}"] == "NV2"


@pytest.mark.parametrize("stem,links", [("dgx-a100", 12), ("a100-8gpu", 12), ("hgx-h100", 18),
                                        ("hgx-h200", 18)])
def test_nvswitch_systems_have_all_pairs_at_full_links(stem, links):
    layout = layout_of(stem)
    assert layout.nvswitch is True and layout.nvswitch_basis == "link counts"
    assert set(layout.nvlink_pairs.values()) == {links} and len(layout.nvlink_pairs) == 28
    assert 7 * links > MAX_NVLINKS_PER_GPU
    assert layout.ring_order == list(range(8))
    assert "nvlink-uneven" not in codes(layout)


def test_nvlink_bridge_pair_is_an_island_apart_from_a_pcie_gpu():
    layout = layout_of("rtx-a6000")
    assert layout.islands == [["GPU0", "GPU1"], ["GPU2"]]
    assert layout.nvlink_pairs == {("GPU0", "GPU1"): 4}
    assert layout.bandwidth["GPU0"]["GPU1"] == "nvlink"
    assert layout.bandwidth["GPU0"]["GPU2"] == "pcie-host"


def test_dgx_a100_nearest_nics_are_the_two_on_each_gpus_switch():
    layout = layout_of("dgx-a100")
    for gpu in range(8):
        pair = [f"NIC{2 * (gpu // 2)}", f"NIC{2 * (gpu // 2) + 1}"]
        assert layout.nearest_nic[f"GPU{gpu}"] == (pair, "PXB")
    assert "no-nearby-nic" not in codes(layout)


def test_h200_each_gpu_has_its_own_pix_nic_and_nic_legend_names():
    layout = layout_of("hgx-h200")
    assert layout.nearest_nic["GPU1"] == (["NIC3"], "PIX")
    assert {d.name: d.device for d in layout.nics}["NIC3"] == "mlx5_3"
    assert layout.gpus[0].cpu_affinity is None and layout.gpus[0].numa_affinity == "0"


def test_four_socket_a100_warns_for_gpus_without_nearby_nic():
    layout = layout_of("a100-8gpu")
    far = codes(layout)["no-nearby-nic"]
    assert [w.devices[0] for w in far] == ["GPU4", "GPU5", "GPU6", "GPU7"]
    assert layout.nearest_nic["GPU2"] == (["NIC2"], "PXB")
    assert "cross-socket" not in codes(layout)  # NVSwitch carries every GPU pair


def test_pcie_machine_warns_about_cross_socket_pairs_and_rings_around_them():
    layout = layout_of("pcie-5gpu")
    (cross,) = codes(layout)["cross-socket"]
    assert "GPU0-GPU1" in cross.message and "GPU1-GPU2" not in cross.message
    assert cross.devices == ("GPU0", "GPU1", "GPU2", "GPU3", "GPU4")
    assert layout.ring_order == [0, 1, 2, 3, 4]  # PHB pairs 1-2 and 3-4 stay neighbours
    assert layout.bandwidth["GPU1"]["GPU2"] == "pcie-host"
    assert layout.bandwidth["GPU0"]["GPU1"] == "cross-socket"


def test_old_soc_label_counts_as_cross_socket_and_pcie_switch_pairs_are_p2p():
    layout = layout_of("tesla-p40")
    assert layout.nearest_nic["GPU0"] == (["mlx5_0"], "SOC")
    assert len(codes(layout)["no-nearby-nic"]) == 8
    assert layout.bandwidth["GPU0"]["GPU1"] == "pcie-switch"
    assert layout.islands == [[f"GPU{i}"] for i in range(8)]


def test_partial_output_warns_and_fills_missing_rows_from_columns():
    layout = layout_of("hgx-h100")
    (partial,) = codes(layout)["partial"]
    assert partial.devices == ("NIC3", "NIC4", "NIC5", "NIC6", "NIC7", "NIC8", "NIC9")
    assert layout.matrix["NIC5"]["GPU3"] == "PIX"  # from GPU3's row
    assert layout.matrix["NIC3"]["NIC4"] is None  # printed nowhere
    assert layout.nearest_nic["GPU3"] == (["NIC5"], "PIX")


def test_single_gpu_outputs_have_a_trivial_ring():
    assert layout_of("tesla-p4-").ring_order == [0]
    gh200 = layout_of("gh200")
    assert gh200.ring_order == [0] and gh200.gpus[0].gpu_numa_id == "1"
    assert gh200.nearest_nic["GPU0"] == (["NIC0", "NIC1", "NIC2", "NIC3"], "NODE")


def test_desktop_without_nics_has_no_nic_warning_and_numa_na():
    layout = layout_of("gtx1080ti")
    assert layout.nics == [] and layout.nearest_nic == {}
    assert layout.gpus[1].numa_affinity == "N/A"
    assert layout.warnings == []


def test_nvswitch_pair_with_fewer_links_is_flagged():
    text = (DATA / "dgx-a100-8gpu-nv12-10nic.txt").read_text()
    lines = text.splitlines()
    lines[2] = lines[2].replace("NV12", "NV10", 1)  # GPU0 -> GPU1
    lines[3] = lines[3].replace("NV12", "NV10", 1)  # GPU1 -> GPU0
    from gpucoll.topology.layout import analyze
    from gpucoll.topology.smi import observed_from_smi, parse_smi

    layout = analyze(observed_from_smi(parse_smi("\n".join(lines))))
    (uneven,) = codes(layout)["nvlink-uneven"]
    assert uneven.devices == ("GPU0", "GPU1") and "NV12" in uneven.message


def test_ring_search_maximises_the_slowest_hop_first():
    weights = {frozenset(p): w for p, w in [((0, 1), 9), ((1, 2), 1), ((2, 3), 9), ((3, 0), 1),
                                            ((0, 2), 5), ((1, 3), 5)]}
    order = best_ring([0, 1, 2, 3], lambda a, b: weights[frozenset((a, b))])
    assert ring_key(order, lambda a, b: weights[frozenset((a, b))]) == (5, 28)
    assert order == [0, 1, 3, 2]


def test_ring_search_beyond_exhaustive_size_is_a_valid_good_ring():
    n = 12  # pairs (2k, 2k+1) fast, all else slow: the ring must keep each pair adjacent
    order = best_ring(range(n), lambda a, b: 10 if a // 2 == b // 2 else 1)
    assert sorted(order) == list(range(n))
    assert ring_key(order, lambda a, b: 10 if a // 2 == b // 2 else 1) == (1, 6 * 10 + 6)


def test_ring_over_a_subset_of_gpus_follows_the_fast_links():
    layout = layout_of("dgx1")
    assert ring_order(layout, [1, 0, 3, 2]) == [0, 1, 2, 3]  # NV1 0-1, then NV2 1-2, 2-3, 3-0
    assert ring_order(layout, [4]) == [4]


def test_ring_over_unknown_gpus_is_a_value_error():
    with pytest.raises(ValueError, match=r"gpus \[9\] are not in the topology"):
        ring_order(layout_of("rtx-a6000"), [0, 9])
