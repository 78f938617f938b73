"""Reader of saved ``nvidia-smi topo -m`` outputs, as old and new drivers print them.

The matrix is read cell by cell and kept as printed. Tolerated: leading comment or prompt lines,
indentation lost in copying, the matrix ending at any line that is not one of its rows (so a
prompt right below it is fine), tab-separated or tab-expanded text, rows cut off at the end (a
partial copy), blank CPU
affinities, a NIC legend or none, NICs named by their RDMA device (``mlx5_0``) in the header,
and extra columns after the matrix (CPU Affinity, NUMA Affinity, GPU NUMA ID) in any subset.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpucoll.topology.errors import TopologyParseError
from gpucoll.topology.facts import SmiFacts
from gpucoll.topology.labels import is_label

KNOWN_EXTRAS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_LEGEND_ENTRY = re.compile(r"\s*(\S+)\s*=\s*(.*\S)\s*\Z")
_NIC_ENTRY = re.compile(r"\s*(NIC\d+)\s*:\s*(\S+)\s*\Z")


def read_smi(path: str | Path) -> SmiFacts:
    """Parse the saved output in file ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise TopologyParseError(f"cannot read: {exc.strerror}", source=str(path)) from None
    return parse_smi(text, source=str(path))


def parse_smi(text: str, source: str = "<text>") -> SmiFacts:
    """Parse the text of an ``nvidia-smi topo -m`` output; raises TopologyParseError."""
    lines = text.splitlines()
    start = _find_header(lines, source)
    columns, extra_columns = _split_header(lines[start])
    rows: dict[str, tuple[str, ...]] = {}
    extras: dict[str, dict[str, str]] = {}
    end = start + 1
    while end < len(lines) and lines[end].split()[:1] and lines[end].split()[0] in columns:
        name, cells, values = _parse_row(lines[end], columns, extra_columns, source, end + 1)
        if name in rows:
            raise TopologyParseError(f"row {name} appears twice", source=source, line=end + 1)
        rows[name], extras[name] = cells, values
        end += 1
    if not rows:
        raise TopologyParseError("header has no matrix rows below it", source=source,
                                 line=start + 1)
    legend, nic_legend = _parse_legends(lines[end:])
    return SmiFacts(source, columns, extra_columns, rows, extras, nic_legend, legend,
                    tab_separated="\t" in lines[start])


def _find_header(lines: list[str], source: str) -> int:
    """Index of the header line: GPU0 followed by a column name rather than a label (the GPU0
    row has X there). Lines above it (comments, prompts, titles) are ignored."""
    for i, line in enumerate(lines):
        tokens = line.split()
        if tokens[:1] == ["GPU0"] and (len(tokens) == 1 or not is_label(tokens[1])):
            return i
    raise TopologyParseError(
        "no header line found (expected a line of column names starting with GPU0, as "
        "`nvidia-smi topo -m` prints)", source=source)


def _split_header(header: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Device column names, and the names of the columns after the matrix."""
    cut = min((i for i in (header.find(x) for x in KNOWN_EXTRAS) if i >= 0), default=len(header))
    devices = tuple(header[:cut].split())
    extras = tuple(x for x in re.split(r"\t+| {2,}", header[cut:].strip()) if x)
    return devices, extras


def _parse_row(line: str, columns: tuple[str, ...], extra_columns: tuple[str, ...],
               source: str, lineno: int) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """One matrix row: its name, its labels, and its extra values by column name.

    Values never contain blanks, so splitting on whitespace gives the cells, except that a
    blank cell vanishes. nvidia-smi prints N/A for unknown NUMA values but leaves an unknown CPU
    affinity blank, so missing values are the leading ones: the present ones are right-aligned.
    """
    tokens = line.split()
    name, n = tokens[0], len(columns)
    if name not in columns:
        raise TopologyParseError(f"row {name!r} is not a column of the header", source=source,
                                 line=lineno)
    cells = tuple(tokens[1:1 + n])
    if len(cells) < n:
        raise TopologyParseError(f"row {name} has {len(cells)} cells, the header has {n} columns",
                                 source=source, line=lineno)
    for column, cell in zip(columns, cells, strict=True):
        if not is_label(cell):
            raise TopologyParseError(f"row {name}, column {column}: unknown label {cell!r}",
                                     source=source, line=lineno)
    if cells[columns.index(name)] != "X":
        raise TopologyParseError(f"row {name} is not X on the diagonal", source=source, line=lineno)
    values = tokens[1 + n:]
    if len(values) > len(extra_columns):
        raise TopologyParseError(f"row {name} has {len(values)} values after the matrix, the "
                                 f"header names {len(extra_columns)} columns", source=source,
                                 line=lineno)
    padded = [""] * (len(extra_columns) - len(values)) + values
    return name, cells, dict(zip(extra_columns, padded, strict=True))


def _parse_legends(lines: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The label legend and the NIC legend (NIC0 -> mlx5_0) found below the matrix, if any."""
    legend: dict[str, str] = {}
    nic_legend: dict[str, str] = {}
    for line in lines:
        nic = _NIC_ENTRY.match(line)
        entry = None if nic else _LEGEND_ENTRY.match(line)
        if nic:
            nic_legend[nic.group(1)] = nic.group(2)
        elif entry:
            legend[entry.group(1)] = entry.group(2)
    return legend, nic_legend
