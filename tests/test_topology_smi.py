"""The nvidia-smi reader accepts every saved output, old and new, and keeps cells as printed."""

from pathlib import Path

import pytest

from gpucoll.errors import TopologyParseError
from gpucoll.topology.smi import parse_smi, read_smi

DATA = Path(__file__).parent / "data" / "topology"
SAVED = sorted(DATA.glob("*.txt"))


def saved(stem: str) -> Path:
    return next(p for p in SAVED if p.name.startswith(stem))


def test_fixtures_are_the_saved_outputs():
    assert len(SAVED) >= 12


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_every_saved_output_parses_with_x_on_the_diagonal(path):
    smi = read_smi(path)
    for name, cells in smi.rows.items():
        assert cells[smi.columns.index(name)] == "X"
        assert len(cells) == len(smi.columns)


def test_new_driver_columns_and_nic_legend_are_read():
    smi = read_smi(saved("dgx-a100"))
    assert smi.columns[:2] == ("GPU0", "GPU1") and smi.columns[-1] == "NIC9"
    assert smi.extra_columns == ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
    assert smi.nic_legend["NIC7"] == "mlx5_7"
    assert smi.rows["GPU0"][smi.columns.index("NIC1")] == "PXB"
    assert smi.extras["GPU4"] == {"CPU Affinity": "112-127,240-255", "NUMA Affinity": "7",
                                  "GPU NUMA ID": "N/A"}


def test_older_layout_without_gpu_numa_id_column():
    smi = read_smi(saved("a100-8gpu-nv12-3nic-4socket"))
    assert smi.extra_columns == ("CPU Affinity", "NUMA Affinity")
    assert smi.extras["GPU2"] == {"CPU Affinity": "20-39,100-119", "NUMA Affinity": "1"}


def test_tab_separated_output_with_empty_padding_cells():
    smi = read_smi(saved("tesla-p4"))
    assert smi.tab_separated
    assert smi.extras["GPU0"] == {"CPU Affinity": "0-7", "NUMA Affinity": "N/A",
                                  "GPU NUMA ID": "N/A"}


def test_partial_output_keeps_the_complete_rows_only():
    smi = read_smi(saved("hgx-h100"))
    assert list(smi.rows) == [f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1", "NIC2"]
    assert len(smi.columns) == 18 and smi.nic_legend == {}
    assert smi.rows["GPU3"][smi.columns.index("NIC5")] == "PIX"


def test_blank_cpu_affinity_leaves_numa_values_in_their_columns():
    smi = read_smi(saved("hgx-h200"))
    assert smi.extras["GPU0"] == {"CPU Affinity": "", "NUMA Affinity": "0", "GPU NUMA ID": "N/A"}
    assert smi.extras["GPU4"] == {"CPU Affinity": "56", "NUMA Affinity": "1",
                                  "GPU NUMA ID": "N/A"}


def test_rdma_device_named_column_of_old_drivers():
    smi = read_smi(saved("dgx1"))
    assert smi.columns[-1] == "mlx5_0" and smi.nic_legend == {}
    assert smi.rows["mlx5_0"][:4] == ("NODE", "NODE", "PIX", "PIX")


def test_old_soc_label_and_legend_are_kept_as_printed():
    smi = read_smi(saved("tesla-p40"))
    assert smi.rows["GPU0"][-1] == "SOC"
    assert smi.legend["X"] == "Self" and "SOC" in smi.legend


def test_gpu_numa_id_of_grace_hopper():
    smi = read_smi(saved("gh200"))
    assert smi.extras["GPU0"]["GPU NUMA ID"] == "1"


def test_unindented_copy_with_a_prompt_below_parses():
    text = ("$ nvidia-smi topo -m\nGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-7\n"
            "GPU1\tNV2\t X \t0-7\nuser@host:~$ \n")
    smi = parse_smi(text)
    assert smi.columns == ("GPU0", "GPU1") and list(smi.rows) == ["GPU0", "GPU1"]
    assert smi.extras["GPU1"] == {"CPU Affinity": "0-7"}


def test_text_without_header_is_an_error_naming_the_source():
    with pytest.raises(TopologyParseError, match="saved.txt: no header line"):
        parse_smi("nvidia-smi: command not found\n", source="saved.txt")


def test_unknown_label_is_an_error_naming_line_and_column():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tFOO\t X \n"
    expected = r"t:3: row GPU1, column GPU0: unknown label 'FOO'"
    with pytest.raises(TopologyParseError, match=expected):
        parse_smi(text, source="t")


def test_short_row_is_an_error():
    with pytest.raises(TopologyParseError, match="row GPU0 has 1 cells, the header has 2"):
        parse_smi("\tGPU0\tGPU1\nGPU0\t X\n")


def test_missing_file_is_a_parse_error():
    with pytest.raises(TopologyParseError, match="cannot read"):
        read_smi(DATA / "no-such-file.txt")


def test_parse_errors_are_exported_in_the_one_hierarchy_and_pickle_with_their_place():
    import pickle

    import gpucoll

    with pytest.raises(gpucoll.GpucollError) as info:
        parse_smi("\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tFOO\t X \n", source="t.txt")
    err = pickle.loads(pickle.dumps(info.value))
    assert type(err) is gpucoll.TopologyParseError and isinstance(err, ValueError)
    assert (str(err), err.source, err.line) == (str(info.value), "t.txt", 3)
    assert issubclass(gpucoll.TopologyUnavailable, gpucoll.GpucollError)
