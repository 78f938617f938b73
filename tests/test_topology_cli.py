"""`gpucoll topo`: this CPU-only machine's one-line answer, and every saved output rendered."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gpucoll.topology.probe import read_sysfs
from gpucoll.topology.render import main
from gpucoll.topology.smi import read_smi

DATA = Path(__file__).parent / "data" / "topology"
SAVED = sorted(DATA.glob("*.txt"))
no_gpu_here = pytest.mark.skipif(bool(read_sysfs("/").gpus), reason="this machine has a GPU")


@no_gpu_here
def test_without_gpu_topo_prints_one_line_and_fails():
    proc = subprocess.run([sys.executable, "-m", "gpucoll", "topo"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpucoll topo: no NVIDIA GPU on this machine")


def test_unreadable_saved_file_is_one_line_and_fails(capsys, tmp_path):
    bad = tmp_path / "topo.txt"
    bad.write_text("not a topology\n")
    assert main(["--from", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no header line" in err


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_saved_output_renders_as_matrix_with_legend(path, capsys):
    assert main(["--from", str(path)]) == 0
    out = capsys.readouterr().out
    smi = read_smi(path)
    header = out.splitlines()[0].split()
    assert header[:len(smi.columns)] == list(smi.columns)
    assert "Legend:" in out and "Suggested ring order: GPU0" in out


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_saved_output_renders_as_json_with_printed_labels(path, capsys):
    assert main(["--from", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    smi = read_smi(path)
    assert doc["schema"] == "gpucoll.topology/1"
    assert [d["name"] for d in doc["devices"]] == list(smi.columns)
    for dev in doc["devices"]:
        assert dev["kind"] == ("gpu" if dev["name"].startswith("GPU") else "nic")
        if dev["kind"] == "nic":
            assert dev["device"] == smi.nic_legend.get(dev["name"], dev["device"])
    for row, cells in smi.rows.items():
        assert [doc["matrix"][row][c] for c in smi.columns] == list(cells)
    assert sorted(doc["ring_order"]) == sorted(d["index"] for d in doc["devices"]
                                               if d["kind"] == "gpu")
    assert {"nvlink", "nearest_nic", "bandwidth", "warnings"} <= set(doc)


def test_json_nic_legend_names_are_devices(capsys):
    assert main(["--from", str(DATA / "dgx-a100-8gpu-nv12-10nic.txt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    nic3 = next(d for d in doc["devices"] if d["name"] == "NIC3")
    assert nic3 == nic3 | {"kind": "nic", "device": "mlx5_3"}
    assert doc["nvlink"]["nvswitch"] is True
    assert doc["nearest_nic"]["GPU2"] == {"nics": ["NIC2", "NIC3"], "label": "PXB"}


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_saved_output_renders_as_dot(path, capsys):
    assert main(["--from", str(path), "--dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph topology {") and out.rstrip().endswith("}")
    for name in read_smi(path).columns:
        assert f'"{name}" [shape=' in out
    assert out.count("{") == out.count("}")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_saved_output_renders_as_png(path, tmp_path, capsys):
    out = tmp_path / "topo.png"
    assert main(["--from", str(path), "--png", str(out)]) == 0
    width, height = png_size(out.read_bytes())
    assert width >= 400 and height >= 300
    from matplotlib.image import imread

    pixels = imread(out)
    colours = {tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}
    assert len(colours) > 20  # boxes, lines and text, not a blank canvas


def test_json_and_dot_together_are_refused(capsys):
    assert main(["--from", str(SAVED[0]), "--json", "--dot"]) == 2


def test_picture_of_nvswitch_machine_joins_each_gpu_to_the_switch():
    from gpucoll.topology import load
    from gpucoll.topology.render import NVSWITCH, build_graph

    nodes, edges = build_graph(load(DATA / "dgx-a100-8gpu-nv12-10nic.txt"))
    nvlinks = [e for e in edges if e.kind == "nvlink"]
    assert sorted(e.a for e in nvlinks) == [f"GPU{i}" for i in range(8)]
    assert {e.b for e in nvlinks} == {NVSWITCH} and {e.label for e in nvlinks} == {"NV12"}
    assert len([e for e in edges if e.kind == "pcie"]) == 16  # two PXB NICs per GPU
    groups = {n.name: n.group for n in nodes}
    assert groups["GPU0"] == groups["NIC1"] == "NUMA 3" and groups["NIC8"] is None


def test_picture_of_pcie_machine_draws_only_each_gpus_nearest_peers():
    from gpucoll.topology import load
    from gpucoll.topology.render import build_graph

    _, edges = build_graph(load(DATA / "tesla-p40-8gpu-pcie-switch-pix-pxb-old-soc-legend.txt"))
    assert len(edges) == 12 and {e.label for e in edges} == {"PIX"}
