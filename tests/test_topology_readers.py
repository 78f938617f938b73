"""NVML and sysfs readers fed recorded answers and built PCI trees, and the probe over them.

Fixtures (tests/data/topology/make_fixtures.py) are built from the saved nvidia-smi outputs, so
the layout computed from NVML + sysfs must print those outputs' labels cell for cell.
"""

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpucoll.topology import TopologyUnavailable, probe
from gpucoll.topology.layout import PciDevice
from gpucoll.topology.probe import cpulist, normalize_bus_id, pci_label, read_nvml, read_sysfs
from gpucoll.topology.render import main
from gpucoll.topology.smi import read_smi

DATA = Path(__file__).parent / "data" / "topology"


class FakeNvml:
    """Replays recorded NVML answers with pynvml's function names; null -> NOT_SUPPORTED."""

    NVML_NVLINK_MAX_LINKS = 36
    NVML_P2P_CAPS_INDEX_READ = (0,)  # nvidia-ml-py 13 exports this one as a tuple
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0

    class NVMLError(Exception):
        pass

    def __init__(self, record: dict, init_error: str | None = None):
        self.record, self.init_error, self.shutdowns = record, init_error, 0

    def _answer(self, value):
        if value is None:
            raise self.NVMLError("Not Supported")
        return value

    def _link(self, h, link, key):
        links = self.record["gpus"][h]["nvlinks"]
        return self._answer(links[link][key] if link < len(links) else None)

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return self.record["driver_version"]

    def nvmlDeviceGetCount(self):
        return len(self.record["gpus"])

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.record["gpus"][h]["name"]

    def nvmlDeviceGetUUID(self, h):
        return self.record["gpus"][h]["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.record["gpus"][h]["busId"].encode())

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.record["gpus"][h]["memory_total"])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._answer(self.record["gpus"][h]["pcie"][0])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._answer(self.record["gpus"][h]["pcie"][1])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._answer(self.record["gpus"][h]["pcie"][2])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._answer(self.record["gpus"][h]["pcie"][3])

    def nvmlDeviceGetNumaNodeId(self, h):
        return self._answer(self.record["gpus"][h]["numa_node_id"])

    def nvmlDeviceGetCpuAffinity(self, h, size):
        return self.record["gpus"][h]["cpu_affinity"][:size]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return self._link(h, link, "state")

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self._link(h, link, "version")

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self._link(h, link, "remote_busId"))

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self._link(h, link, "remote_type")

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.record["pairs"][f"{a},{b}"]["ancestor"]

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert isinstance(index, int), "pynvml wants an int capability index"
        return self.record["pairs"][f"{a},{b}"]["p2p_read" if index == 0 else "p2p_nvlink"]


def recorded(name: str) -> dict:
    return json.loads((DATA / f"nvml-{name}.json").read_text())


def build_sysfs(root: Path, name: str) -> Path:
    """Materialise a sysfs tree: device directories under sys/devices, symlinks in
    sys/bus/pci/devices, attribute files, infiniband/net/driver entries."""
    devices = root / "sys" / "devices"
    bus = root / "sys" / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    for spec in json.loads((DATA / f"sysfs-{name}.json").read_text()):
        path = devices / spec["root"]
        for bridge in spec["bridges"]:
            path = path / bridge
            _bridge(path, bus)
        path = path / spec["address"]
        path.mkdir(parents=True)
        for key in ("vendor", "device", "class"):
            (path / key).write_text(f"0x{spec[key]:04x}\n")
        for key in ("numa_node", "local_cpulist", "current_link_speed", "max_link_speed",
                    "current_link_width", "max_link_width"):
            (path / key).write_text(f"{spec[key]}\n")
        for sub in ("rdma", "net"):
            for item in spec[sub]:
                (path / {"rdma": "infiniband", "net": "net"}[sub] / item).mkdir(parents=True)
        if spec["driver"]:
            (path / "driver").symlink_to(f"/sys/bus/pci/drivers/{spec['driver']}")
        (bus / spec["address"]).symlink_to(os.path.relpath(path, bus))
    return root


def _bridge(path: Path, bus: Path) -> None:
    if path.exists():
        return
    path.mkdir(parents=True)
    (path / "vendor").write_text("0x8086\n")
    (path / "class").write_text("0x060400\n")
    (bus / path.name).symlink_to(os.path.relpath(path, bus))


def saved_matrix(stem: str) -> dict:
    smi = read_smi(next(DATA.glob(stem + "*.txt")))
    return {a: dict(zip(smi.columns, cells, strict=True)) for a, cells in smi.rows.items()}


# --- NVML reader ---------------------------------------------------------------------------

def test_nvml_reader_returns_identity_links_affinity_and_pairs():
    fake = FakeNvml(recorded("dgx-a100"))
    facts = read_nvml(fake)
    gpu = facts.gpus[2]
    assert (gpu.index, gpu.name, gpu.memory_bytes) == (2, "NVIDIA A100-SXM4-40GB", 42949672960)
    assert gpu.bus_id == "0000:50:00.0" and gpu.cpus == "16-31,144-159"
    assert gpu.pcie.gen == 4 and gpu.pcie.max_width == 16 and gpu.gpu_numa_id is None
    assert len(gpu.nvlinks) == 12 and {lk.remote_kind for lk in gpu.nvlinks} == {"switch"}
    assert all(lk.active and lk.version == 3 for lk in gpu.nvlinks)
    pair = next(p for p in facts.pairs if (p.a, p.b) == (0, 1))
    assert pair.common_ancestor == 20 and pair.p2p_read and pair.p2p_nvlink
    assert len(facts.pairs) == 28 and facts.driver_version == "535.104.05"
    assert fake.shutdowns == 1


def test_nvml_reader_keeps_inactive_links_without_remote():
    facts = read_nvml(FakeNvml(recorded("dgx1-v100")))
    links = facts.gpus[0].nvlinks
    assert len(links) == 6 and all(lk.active for lk in links)
    assert {lk.remote_kind for lk in links} == {"gpu"}


def test_nvml_start_failure_is_topology_unavailable():
    with pytest.raises(TopologyUnavailable, match="NVML cannot start: Driver Not Loaded"):
        read_nvml(FakeNvml(recorded("dgx-a100"), init_error="Driver Not Loaded"))


def test_bus_ids_and_cpu_lists_are_written_the_linux_way():
    assert normalize_bus_id("00000000:4B:00.0") == "0000:4b:00.0"
    assert cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


# --- sysfs reader --------------------------------------------------------------------------

def test_sysfs_reader_finds_gpus_nvswitches_and_nics_with_their_bridges(tmp_path):
    facts = read_sysfs(build_sysfs(tmp_path, "dgx-a100"))
    assert len(facts.gpus) == 8 and len(facts.switches) == 6 and len(facts.nics) == 10
    gpu = facts.gpus[0]
    assert gpu.root == "pci0000:00" and gpu.bridges[:2] == ("0000:00:01.1", "0000:01:00.0")
    assert len(gpu.bridges) == 5 and gpu.numa_node == 3 and gpu.cpus == "48-63,176-191"
    assert gpu.link.gen == 4 and gpu.link.width == 16 and gpu.driver == "nvidia"
    assert facts.nics[0].rdma_names == ("mlx5_0",) and facts.nics[0].net_names == ("ib0",)


def test_sysfs_reader_of_a_missing_tree_finds_nothing(tmp_path):
    facts = read_sysfs(tmp_path)
    assert facts.gpus == () and facts.nics == ()


def test_pci_labels_from_bridge_chains():
    def d(addr, root="pci0000:00", bridges=(), numa=0):
        return PciDevice(addr, 0x10DE, 0, 0x030200, root, tuple(bridges), numa)

    switch = ["0000:00:01.0", "0000:01:00.0"]
    assert pci_label(d("a", bridges=switch + ["p1"]), d("b", bridges=switch + ["p2"])) == "PIX"
    assert pci_label(d("a", bridges=switch + ["p1", "u", "q"]),
                     d("b", bridges=switch + ["p2"])) == "PXB"
    assert pci_label(d("a", bridges=["r1"]), d("b", bridges=["r2"])) == "PHB"
    assert pci_label(d("a", root="pci0000:40"), d("b")) == "NODE"
    assert pci_label(d("a", root="pci0000:40", numa=1), d("b")) == "SYS"
    assert pci_label(d("a"), d("a")) == "X"


# --- layouts from NVML + sysfs reproduce the saved outputs ----------------------------------

def test_nvml_and_sysfs_reproduce_the_saved_dgx_a100_matrix(tmp_path):
    layout = probe(nvml=FakeNvml(recorded("dgx-a100")), sysfs_root=build_sysfs(tmp_path,
                                                                              "dgx-a100"))
    assert layout.observed.source == "nvml"
    assert layout.matrix == saved_matrix("dgx-a100")
    assert layout.nvswitch is True and layout.nvswitch_basis == "nvml"
    assert [d.device for d in layout.nics] == [f"mlx5_{i}" for i in range(10)]
    assert layout.gpus[0].numa_affinity == "3" and layout.gpus[0].gpu_numa_id == "N/A"
    assert layout.nearest_nic["GPU5"] == (["NIC4", "NIC5"], "PXB")
    assert layout.ring_order == list(range(8)) and layout.warnings == []


def test_nvml_and_sysfs_reproduce_the_saved_dgx1_matrix(tmp_path):
    layout = probe(nvml=FakeNvml(recorded("dgx1-v100")),
                   sysfs_root=build_sysfs(tmp_path, "dgx1-v100"))
    saved = saved_matrix("dgx1")
    rename = {"mlx5_0": "NIC0"}  # new drivers name NICs NIC#, with mlx5_0 in the legend
    expected = {rename.get(a, a): {rename.get(b, b): v for b, v in row.items()}
                for a, row in saved.items()}
    assert layout.matrix == expected
    assert layout.nvswitch is False and layout.nics[0].device == "mlx5_0"
    assert layout.ring_order == [0, 3, 2, 1, 5, 6, 7, 4]
    assert [w.code for w in layout.warnings].count("no-nearby-nic") == 6


def test_inactive_nvlink_is_reported_down_and_uneven(tmp_path):
    record = copy.deepcopy(recorded("dgx-a100"))
    record["gpus"][3]["nvlinks"][5]["state"] = 0
    layout = probe(nvml=FakeNvml(record), sysfs_root=build_sysfs(tmp_path, "dgx-a100"))
    assert layout.matrix["GPU3"]["GPU0"] == "NV11" and layout.matrix["GPU1"]["GPU2"] == "NV12"
    warnings = {w.code: w for w in layout.warnings}
    assert warnings["nvlink-down"].devices == ("GPU3",)
    assert "link 5" in warnings["nvlink-down"].message
    assert warnings["nvlink-uneven"].devices == ("GPU3",)


def test_pcie_link_below_its_max_is_reported(tmp_path):
    record = copy.deepcopy(recorded("dgx-a100"))
    record["gpus"][6]["pcie"] = [3, 4, 8, 16]
    layout = probe(nvml=FakeNvml(record), sysfs_root=build_sysfs(tmp_path, "dgx-a100"))
    (slow,) = [w for w in layout.warnings if w.code == "pcie-degraded"]
    assert slow.devices == ("GPU6",) and "gen 3 x8, below its max gen 4 x16" in slow.message


def test_gpu_pair_without_p2p_read_is_reported(tmp_path):
    record = copy.deepcopy(recorded("dgx1-v100"))
    record["pairs"]["0,5"]["p2p_read"] = 2  # NVML_P2P_STATUS_GPU_NOT_SUPPORTED
    layout = probe(nvml=FakeNvml(record), sysfs_root=build_sysfs(tmp_path, "dgx1-v100"))
    (blocked,) = [w for w in layout.warnings if w.code == "p2p-unavailable"]
    assert blocked.devices == ("GPU0", "GPU5") and "GPU0-GPU5" in blocked.message


# --- sysfs alone: GPUs on the bus without a driver ------------------------------------------

def test_without_driver_sysfs_shows_pcie_paths_of_the_saved_machine(tmp_path):
    layout = probe(nvml=FakeNvml({}, init_error="Driver Not Loaded"),
                   sysfs_root=build_sysfs(tmp_path, "pcie-5gpu"))
    assert layout.observed.source == "sysfs"
    assert layout.matrix == saved_matrix("pcie-5gpu")  # the Ethernet NIC has no RDMA: not shown
    assert layout.gpus[0].numa_affinity == "1" and layout.gpus[1].cpu_affinity == "0-7,16-23"
    codes = {w.code: w for w in layout.warnings}
    assert "Driver Not Loaded" in codes["no-driver"].message
    assert codes["pcie-degraded"].devices == ("GPU4",)
    assert codes["cross-socket"].devices[0] == "GPU0"
    assert layout.ring_order == [0, 1, 2, 3, 4]


def test_nothing_on_the_bus_is_one_line_naming_both_sources(tmp_path):
    with pytest.raises(TopologyUnavailable) as info:
        probe(nvml=FakeNvml({}, init_error="NVML Shared Library Not Found"), sysfs_root=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "no NVIDIA GPU" in message
    assert "NVML Shared Library Not Found" in message and "0x10de" in message


no_gpu_here = pytest.mark.skipif(bool(read_sysfs("/").gpus), reason="this machine has a GPU")


@no_gpu_here
def test_cli_reports_what_sysfs_shows_without_driver(tmp_path, capsys):
    root = build_sysfs(tmp_path, "pcie-5gpu")
    assert main(["--sysfs-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" " * 8 + "GPU0    GPU1") and "warning [no-driver]" in out
    assert "NVIDIA device 0x2684" in out


@no_gpu_here
def test_probe_ring_order_is_none_without_gpu():
    from gpucoll.topology import probe_ring_order

    assert probe_ring_order() is None


def test_nvml_failing_midway_falls_back_to_sysfs(tmp_path):
    class LostGpu(FakeNvml):
        def nvmlDeviceGetName(self, h):
            raise self.NVMLError("GPU is lost")

    fake = LostGpu(recorded("dgx-a100"))
    layout = probe(nvml=fake, sysfs_root=build_sysfs(tmp_path, "dgx-a100"))
    assert layout.observed.source == "sysfs" and fake.shutdowns == 1
    assert "GPU is lost" in layout.warnings[0].message
    assert layout.nvswitch is True and layout.nvswitch_basis == "sysfs"
