"""Saved outputs as they arrive after being pasted: every real output, damaged every way a copy
damages text, reads back to the same matrix, and what had to be inferred is said."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpucoll.errors import TopologyParseError
from gpucoll.topology.layout import analyze
from gpucoll.topology.smi import DEFAULT_EXTRAS, observed_from_smi, parse_smi

DATA = Path(__file__).parent / "data" / "topology"
SAVED = sorted(DATA.glob("*.txt"))
LABEL = re.compile(r"(?<![\w/])(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)(?![\w/])")


def _header_index(lines: list[str]) -> int:
    return next(i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]
                or line.lstrip().startswith("GPU0") and "X" not in line.split()[1:2])


def _edit_header(text: str, edit) -> str:
    lines = text.split("\n")
    i = _header_index(lines)
    lines[i:i + 1] = edit(lines[i])
    return "\n".join(lines)


def _glue(header: str) -> list[str]:
    """Every separator lost, as a web page's table header often comes out."""
    return ["".join(header.split("\t")) if "\t" in header else re.sub(r" {2,}|^ +", "", header)]


def _half_glued(header: str) -> list[str]:
    """The GPUs glued together, the rest still tab-separated (the example of the report)."""
    names = header.split()
    gpus = [n for n in names if n.startswith("GPU") and n[3:].isdigit()]
    rest = re.sub(r"^\s*" + r"\s*".join(gpus) + r"\s*", "", header)
    return ["".join(gpus) + "\t" + rest]


def _cut_legend(text: str) -> str:
    """The text cut in the middle of the legend (or of the NIC legend, when there is one)."""
    at = text.rfind("Legend:")
    return text if at < 0 else text[: at + (len(text) - at) // 2]


def _tabs_for_spaces(text: str) -> str:
    if "\t" in text:
        return text.replace("\t", "    ")
    return re.sub(r" {2,}", "\t", text)


VARIANTS = {
    "windows-line-ends": lambda t: t.replace("\n", "\r\n"),
    "ansi-colours": lambda t: "\x1b[1m" + LABEL.sub("\x1b[32m\\1\x1b[0m", t) + "\x1b[0m",
    "tabs-and-spaces-swapped": _tabs_for_spaces,
    "non-breaking-spaces": lambda t: t.replace("    ", "\u00a0\u00a0\u00a0\u00a0"),
    "legend-cut": _cut_legend,
    "header-glued": lambda t: _edit_header(t, _glue),
    "header-half-glued": lambda t: _edit_header(t, _half_glued),
    "header-lost": lambda t: _edit_header(t, lambda h: []),
    "everything": lambda t: _cut_legend(_edit_header(t, _glue)).replace("\n", "\r\n"),
}


def _variants() -> list:
    out = []
    for path in SAVED:
        for name in VARIANTS:
            out.append(pytest.param(path, name, id=f"{path.stem[:24]}-{name}"))
    return out


@pytest.mark.parametrize("path,variant", _variants())
def test_a_damaged_paste_reads_back_to_the_same_matrix(path, variant):
    text = path.read_text()
    clean = parse_smi(text)
    damaged = parse_smi(VARIANTS[variant](text))
    assert damaged.columns == clean.columns
    assert damaged.rows == clean.rows
    if variant == "header-lost":  # values after the matrix: taken in nvidia-smi's order
        for name, values in clean.extras.items():
            named = {k: v for k, v in damaged.extras[name].items() if v}
            assert set(named.values()) == {v for v in values.values() if v}
            assert set(named) <= set(DEFAULT_EXTRAS)
    else:
        assert damaged.extras == clean.extras and damaged.extra_columns == clean.extra_columns
    if variant not in ("legend-cut", "everything"):
        assert damaged.nic_legend == clean.nic_legend


@pytest.mark.parametrize("path,variant", _variants())
def test_what_was_inferred_is_said_and_nothing_else(path, variant):
    text = path.read_text()
    clean = parse_smi(text)
    notes = parse_smi(VARIANTS[variant](text)).notes
    gpus = sum(c.startswith("GPU") for c in clean.columns)
    # a header of one device (or one GPU, for the half-glued one) has no separator to lose
    glued = {"header-glued": len(clean.columns), "everything": len(clean.columns),
             "header-half-glued": gpus}
    if variant == "header-lost" or glued.get(variant, 0) > 1:
        assert notes, "an inferred header must be reported"
    elif variant in ("legend-cut", "everything"):
        assert all("NIC legend" in n for n in notes)
    else:
        assert notes == ()


def test_the_report_example_header_is_read_from_its_row_labels():
    text = ("GPU0GPU1GPU2GPU3mlx5_0\tmlx5_2\tCPU Affinity\n"
            "GPU0\t X \tNV2\tNV2\tSYS\tPIX\tSYS\t0-11\n"
            "GPU1\tNV2\t X \tSYS\tNV2\tPIX\tSYS\t0-11\n"
            "GPU2\tNV2\tSYS\t X \tNV2\tSYS\tPIX\t12-23\n"
            "GPU3\tSYS\tNV2\tNV2\t X \tSYS\tPIX\t12-23\n"
            "mlx5_0\tPIX\tPIX\tSYS\tSYS\t X \tSYS\n"
            "mlx5_2\tSYS\tSYS\tPIX\tPIX\tSYS\t X \n")
    smi = parse_smi(text)
    assert smi.columns == ("GPU0", "GPU1", "GPU2", "GPU3", "mlx5_0", "mlx5_2")
    assert smi.extras["GPU2"] == {"CPU Affinity": "12-23"}
    assert smi.notes and "lost separators" in smi.notes[0] and "GPU0 GPU1" in smi.notes[0]


def test_inferences_become_layout_warnings():
    text = _edit_header((DATA / "dgx-a100-8gpu-nv12-10nic.txt").read_text(), _glue)
    layout = analyze(observed_from_smi(parse_smi(text)))
    inferred = [w for w in layout.warnings if w.code == "inferred"]
    assert inferred and inferred[0].message.startswith("read from a damaged copy:")
    assert layout.nearest_nic["GPU0"] == (["NIC0", "NIC1"], "PXB")


def test_a_cut_nic_legend_is_completed_after_its_pattern_and_said():
    text = (DATA / "dgx-a100-8gpu-nv12-10nic.txt").read_text()
    cut = text[: text.index("  NIC7: mlx5_7")]
    smi = parse_smi(cut)
    assert smi.nic_legend["NIC9"] == "mlx5_9"
    assert smi.notes == ("the NIC legend stops short of NIC7, NIC8, NIC9: named mlx5_7, "
                         "mlx5_8, mlx5_9 after the pattern of the entries it has",)


def test_a_nic_legend_without_a_pattern_is_left_as_it_is():
    text = (DATA / "a10-4gpu-pcie-sys-2nic.txt").read_text().replace("NIC1: mlx5_1", "")
    text = text.replace("NIC0: mlx5_0", "NIC0: eth_roce")
    smi = parse_smi(text)
    assert smi.nic_legend == {"NIC0": "eth_roce"} and smi.notes == ()


def test_columns_that_no_row_and_no_header_name_continue_the_numbering():
    text = _edit_header((DATA / "hgx-h100-8gpu-nv18-10nic-tab-separated-PARTIAL.txt")
                        .read_text(), lambda h: [])
    smi = parse_smi(text)
    assert smi.columns[-7:] == tuple(f"NIC{i}" for i in range(3, 10))
    assert any("NIC3, NIC4" in n and "continuing the numbering" in n for n in smi.notes)


def test_extra_columns_gpucoll_does_not_know_are_kept_by_name():
    text = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA ID\tPower Domain\n"
            "GPU0\t X \tNV4\t0-7\t0\tA\nGPU1\tNV4\t X \t8-15\t1\tB\n")
    smi = parse_smi(text)
    assert smi.extra_columns == ("CPU Affinity", "NUMA ID", "Power Domain")
    assert smi.extras["GPU1"] == {"CPU Affinity": "8-15", "NUMA ID": "1", "Power Domain": "B"}
    layout = analyze(observed_from_smi(smi))
    assert layout.gpus[1].numa_affinity == "1"  # NUMA ID means what NUMA Affinity means


def test_labels_that_lost_their_separators_are_split():
    smi = parse_smi("GPU0 GPU1 GPU2\nGPU0 XNV4SYS\nGPU1NV4 X SYS\nGPU2 SYSSYSX\n")
    assert smi.rows == {"GPU0": ("X", "NV4", "SYS"), "GPU1": ("NV4", "X", "SYS"),
                        "GPU2": ("SYS", "SYS", "X")}


def test_a_markdown_table_paste_is_read():
    smi = parse_smi("| | GPU0 | GPU1 | CPU Affinity |\n|---|---|---|---|\n"
                    "| GPU0 | X | NV1 | 0-3 |\n| GPU1 | NV1 | X | 0-3 |\n")
    assert smi.columns == ("GPU0", "GPU1") and smi.extras["GPU1"] == {"CPU Affinity": "0-3"}


def test_a_corrupt_cell_is_still_an_error_naming_its_line_and_column():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tFOO\t X \n"
    with pytest.raises(TopologyParseError, match=r"t:3: row GPU1, column GPU0: unknown label"):
        parse_smi(text, source="t")


def test_text_with_neither_header_nor_rows_is_an_error():
    with pytest.raises(TopologyParseError, match="no header line found and no matrix rows"):
        parse_smi("Failed to initialize NVML: Driver/library version mismatch\r\n")
