"""Build the recorded-NVML and sysfs-tree fixtures from the saved nvidia-smi outputs here.

    python tests/data/topology/make_fixtures.py   # rewrites nvml-*.json and sysfs-*.json

The PCI trees are plausible designs that give exactly the labels the saved outputs print (bus
numbers are invented); NVLink counts, CPU lists and NUMA nodes are the saved outputs' own.
Recorded NVML answers: null stands for NVML_ERROR_NOT_SUPPORTED.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

HERE = Path(__file__).parent
# NVML_TOPOLOGY_* value of each PCIe label
ANCESTOR = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


def cpu_mask(cpulist: str) -> list[int]:
    """'0-1,4' -> [0b10011]: 16 64-bit words as nvmlDeviceGetCpuAffinity fills them."""
    words = [0] * 16
    for part in cpulist.split(","):
        lo, _, hi = part.partition("-")
        for cpu in range(int(lo), int(hi or lo) + 1):
            words[cpu // 64] |= 1 << (cpu % 64)
    return words


def dev(address, root, bridges, *, vendor=0x10DE, device=0x20B0, pci_class=0x030200,
        numa=-1, cpus="", gen=4, max_gen=4, width=16, max_width=16, rdma=(), net=(),
        driver=None) -> dict:
    speeds = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
              5: "32.0 GT/s PCIe"}
    return {"address": address, "root": root, "bridges": list(bridges), "vendor": vendor,
            "device": device, "class": pci_class, "numa_node": numa, "local_cpulist": cpus,
            "current_link_speed": speeds[gen], "max_link_speed": speeds[max_gen],
            "current_link_width": width, "max_link_width": max_width, "rdma": list(rdma),
            "net": list(net), "driver": driver}


def nic(address, root, bridges, name, **kw) -> dict:
    return dev(address, root, bridges, vendor=0x15B3, device=0x101B, pci_class=0x020700,
               rdma=[name], net=[f"ib{name.split('_')[1]}"], driver="mlx5_core", **kw)


def dgx_a100_sysfs() -> list[dict]:
    """4 root complexes (NUMA 3, 1, 7, 5), each: root port, switch, and per GPU or NIC a second
    switch level (so GPU-NIC and NIC-NIC are PXB); storage NICs and NVSwitches elsewhere."""
    cpus = {3: "48-63,176-191", 1: "16-31,144-159", 7: "112-127,240-255",
            5: "80-95,208-223", 6: "96-111,224-239"}
    out = []
    for k, (base, numa) in enumerate(zip((0x00, 0x40, 0x80, 0xB0), (3, 1, 7, 5), strict=True)):
        root, up = f"pci0000:{base:02x}", [f"0000:{base:02x}:01.1", f"0000:{base + 1:02x}:00.0"]
        for j in range(4):  # GPU, NIC, GPU, NIC
            chain = up + [f"0000:{base + 2:02x}:{4 * j:02x}.0", f"0000:{base + 3 + 2 * j:02x}:00.0",
                          f"0000:{base + 4 + 2 * j:02x}:00.0"]
            leaf = f"0000:{base + 0x10 + 4 * j:02x}:00.0"
            if j % 2 == 0:
                out.append(dev(leaf, root, chain, numa=numa, cpus=cpus[numa], driver="nvidia"))
            else:
                out.append(nic(leaf, root, chain, f"mlx5_{2 * k + j // 2}", numa=numa,
                               cpus=cpus[numa]))
    storage = ["0000:e0:01.1", "0000:e1:00.0", "0000:e2:00.0"]
    out += [nic(f"0000:e3:00.{f}", "pci0000:e0", storage, f"mlx5_{8 + f}", numa=6, cpus=cpus[6])
            for f in (0, 1)]
    out += [dev(f"0000:{0xd4 + i:02x}:00.0", "pci0000:d0", ["0000:d0:01.1"], device=0x1AF1,
                pci_class=0x068000, numa=6, cpus=cpus[6], driver=None) for i in range(6)]
    return out


def dgx1_sysfs() -> list[dict]:
    """Two sockets, two root complexes each; GPU2, GPU3 and mlx5_0 share one PCIe switch."""
    out = []
    layout = [("pci0000:00", 0, ["GPU0", "GPU1"]), ("pci0000:18", 0, ["GPU2", "GPU3", "mlx5_0"]),
              ("pci0000:85", 1, ["GPU4", "GPU5"]), ("pci0000:ae", 1, ["GPU6", "GPU7"])]
    cpus = {0: "0-11,24-35", 1: "12-23,36-47"}
    for root, numa, members in layout:
        bus = int(root[-2:], 16)
        up = [f"0000:{bus:02x}:00.0", f"0000:{bus + 1:02x}:00.0"]
        for j, name in enumerate(members):
            chain = up + [f"0000:{bus + 2:02x}:{8 * j:02x}.0"]
            leaf = f"0000:{bus + 3 + j:02x}:00.0"
            if name.startswith("GPU"):
                out.append(dev(leaf, root, chain, device=0x1DB1, numa=numa, cpus=cpus[numa],
                               gen=3, max_gen=3, driver="nvidia"))
            else:
                out.append(nic(leaf, root, chain, name, numa=numa, cpus=cpus[numa], gen=3,
                               max_gen=3))
    return out


def pcie_5gpu_sysfs() -> list[dict]:
    """GPU0 alone on NUMA 1; GPU1+GPU2 and GPU3+GPU4 each on one root complex of NUMA 0 (PHB
    within, NODE between). GPU4's link trained down to gen 3 x8. No driver bound."""
    g = dict(device=0x2684, pci_class=0x030000)
    return [
        dev("0000:01:00.0", "pci0000:00", ["0000:00:01.1"], numa=1, cpus="8-15,24-31", **g),
        dev("0000:41:00.0", "pci0000:40", ["0000:40:01.1"], numa=0, cpus="0-7,16-23", **g),
        dev("0000:42:00.0", "pci0000:40", ["0000:40:03.1"], numa=0, cpus="0-7,16-23", **g),
        dev("0000:81:00.0", "pci0000:80", ["0000:80:01.1"], numa=0, cpus="0-7,16-23", **g),
        dev("0000:82:00.0", "pci0000:80", ["0000:80:03.1"], numa=0, cpus="0-7,16-23", gen=3,
            width=8, **g),
        dev("0000:83:00.0", "pci0000:80", ["0000:80:05.1"], vendor=0x8086, device=0x1533,
            pci_class=0x020000, numa=0, cpus="0-7,16-23", gen=1, max_gen=1, width=1,
            max_width=1, net=["enp67s0"], driver="igb"),
    ]


def read_matrix(name: str) -> dict[str, dict[str, str]]:
    lines = [ln for ln in (HERE / name).read_text().splitlines() if not ln.startswith("#")]
    columns = lines[0].split("CPU Affinity")[0].split()
    rows = {}
    for line in lines[1:]:
        tokens = line.split()
        if not tokens or tokens[0] not in columns:
            break
        rows[tokens[0]] = dict(zip(columns, tokens[1:1 + len(columns)], strict=True))
    return rows


def nvml_record(sysfs: list[dict], smi: str, model: str, memory: int, switches: bool) -> dict:
    """NVML's answers for the GPUs of a sysfs tree, with NVLinks as the saved output counts."""
    matrix = read_matrix(smi)
    gpus = sorted((d for d in sysfs if d["class"] >> 16 == 3), key=lambda d: d["address"])
    nvswitches = [d for d in sysfs if d["class"] >> 16 == 6]
    record = {"driver_version": "535.104.05", "gpus": [], "pairs": {}}
    for i, gpu in enumerate(gpus):
        links = []
        if switches:
            links = [{"state": 1, "version": 3, "remote_busId": _nvml_bus(nvswitches[n // 2]),
                      "remote_type": 2} for n in range(12)]
        else:
            for j, peer in enumerate(gpus):
                label = matrix[f"GPU{i}"][f"GPU{j}"]
                count = int(label[2:]) if label.startswith("NV") else 0
                links += [{"state": 1, "version": 2, "remote_busId": _nvml_bus(peer),
                           "remote_type": 0}] * count
            links += [{"state": 0, "version": None, "remote_busId": None,
                       "remote_type": None}] * (6 - len(links))
        record["gpus"].append({
            "name": model, "uuid": f"GPU-{uuid.UUID(int=0xA100 << 64 | i)}",
            "busId": _nvml_bus(gpu), "memory_total": memory,
            "pcie": [_gen(gpu["current_link_speed"]), _gen(gpu["max_link_speed"]),
                     gpu["current_link_width"],
                     gpu["max_link_width"]],
            "cpu_affinity": cpu_mask(gpu["local_cpulist"]), "numa_node_id": None,
            "nvlinks": links})
    for i in range(len(gpus)):
        for j in range(i + 1, len(gpus)):
            label = _pci_label(gpus[i], gpus[j])
            nvlinked = switches or matrix[f"GPU{i}"][f"GPU{j}"].startswith("NV")
            record["pairs"][f"{i},{j}"] = {"ancestor": ANCESTOR[label], "p2p_read": 0,
                                           "p2p_nvlink": 0 if nvlinked else 5}
    return record


def _pci_label(a: dict, b: dict) -> str:
    from gpucoll.topology.layout import PciDevice
    from gpucoll.topology.probe import pci_label

    def pci(d):
        return PciDevice(d["address"], d["vendor"], d["device"], d["class"], d["root"],
                         tuple(d["bridges"]), d["numa_node"])
    return pci_label(pci(a), pci(b))


def _gen(speed: str) -> int:
    return {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5}[speed.split()[0]]


def _nvml_bus(d: dict) -> str:
    """'0000:4b:00.0' -> '00000000:4B:00.0', as NVML spells bus ids."""
    domain, rest = d["address"].split(":", 1)
    return f"0000{domain}:{rest}".upper()


def main() -> None:
    trees = {"dgx-a100": dgx_a100_sysfs(), "dgx1-v100": dgx1_sysfs(),
             "pcie-5gpu": pcie_5gpu_sysfs()}
    for name, tree in trees.items():
        (HERE / f"sysfs-{name}.json").write_text(json.dumps(tree, indent=1) + "\n")
    records = {
        "dgx-a100": nvml_record(trees["dgx-a100"], "dgx-a100-8gpu-nv12-10nic.txt",
                                "NVIDIA A100-SXM4-40GB", 42949672960, switches=True),
        "dgx1-v100": nvml_record(trees["dgx1-v100"],
                                 "dgx1-v100-8gpu-hybrid-cube-mesh-mlx5-column.txt",
                                 "Tesla V100-SXM2-16GB", 17179869184, switches=False),
    }
    for name, record in records.items():
        (HERE / f"nvml-{name}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
