"""Reader of saved ``nvidia-smi topo -m`` outputs, as old and new drivers print them and as they
survive being pasted: from a terminal, a web page, an issue or a chat.

The matrix is read cell by cell and kept as printed. Tolerated as they are: leading comment or
prompt lines, indentation lost in copying, the matrix ending at any line that is not one of its
rows (so a prompt right below it is fine), tab-separated or tab-expanded text, Windows line
ends, terminal colours (ANSI escapes), non-breaking spaces, table bars (``|``), rows cut off at
the end (a partial copy), blank CPU affinities, a label or NIC legend cut short or missing, NICs
named by their RDMA device (``mlx5_0``) in the header, and extra columns after the matrix (CPU
Affinity, NUMA Affinity, NUMA ID, GPU NUMA ID, or others) in any subset.

A damaged header is read from what the rows say: each printed row has its X in its own column,
so the rows' labels name the columns; a header whose separators were lost
(``GPU0GPU1...mlx5_0``) is split into device names, and one that is gone entirely is rebuilt
from the rows. Whatever was inferred is said in :attr:`SmiFacts.notes`, which the layout
reports as warnings.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpucoll.errors import TopologyParseError
from gpucoll.topology.layout import Device, Finding, Observed, SmiFacts, is_label

# Columns printed after the matrix, longest first (GPU NUMA ID contains NUMA ID).
KNOWN_EXTRAS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID", "NUMA ID")
_EXTRA = re.compile("|".join(re.escape(x) for x in sorted(KNOWN_EXTRAS, key=len, reverse=True)))
# What nvidia-smi prints after the matrix when the header no longer says: in this order.
DEFAULT_EXTRAS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_LEGEND_ENTRY = re.compile(r"\s*(\S+)\s*=\s*(.*\S)\s*\Z")
_NIC_ENTRY = re.compile(r"\s*(NIC\d+)\s*:\s*(\S+)\s*\Z")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_LABELS = re.compile(r"X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC")
_DEVICE = re.compile(r"GPU\d+|NIC\d+|[A-Za-z][A-Za-z0-9]*_[A-Za-z_]*\d+")
_NUMBERED = re.compile(r"(.*?)(\d+)\Z")


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
    lines = clean(text).split("\n")
    first = _first_row(lines)
    header = _header_above(lines, first)
    if first is None:
        where = None if header is None else header + 1
        raise TopologyParseError(
            "no header line found and no matrix rows (expected a line of column names starting "
            "with GPU0, then rows such as `GPU0  X  NV12 ...`, as `nvidia-smi topo -m` prints)"
            if header is None else "header has no matrix rows below it", source=source,
            line=where)
    notes: list[str] = []
    columns, extra_columns = _columns(lines, header, first, notes)
    rows: dict[str, tuple[str, ...]] = {}
    extras: dict[str, dict[str, str]] = {}
    end = first
    while end < len(lines) and _tokens(lines[end])[:1] and _tokens(lines[end])[0] in columns:
        name, cells, values = _parse_row(lines[end], columns, extra_columns, source, end + 1)
        if name in rows:
            raise TopologyParseError(f"row {name} appears twice", source=source, line=end + 1)
        rows[name], extras[name] = cells, values
        end += 1
    legend, nic_legend = _parse_legends(lines[end:])
    _infer_nic_legend(columns, nic_legend, notes)
    tabbed = "\t" in lines[header if header is not None else first]
    return SmiFacts(source, columns, extra_columns, rows, extras, nic_legend, legend,
                    tab_separated=tabbed, notes=tuple(notes))


def clean(text: str) -> str:
    """The text as nvidia-smi printed it: no colours, Unix line ends, plain spaces."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    for odd in ("\u00a0", "\u2007", "\u202f", "|"):  # non-breaking spaces; table bars
        text = text.replace(odd, " ")
    for gone in ("\ufeff", "\u200b", "\u200c", "\u200d"):  # byte-order mark, zero widths
        text = text.replace(gone, "")
    return text


def _tokens(line: str) -> list[str]:
    """Whitespace-separated tokens, with runs of labels that lost their separators
    (``NV12NV12``, ``GPU1NV4``) split apart."""
    out: list[str] = []
    for tok in line.split():
        if is_label(tok):
            out.append(tok)
        else:
            out += _glued_row_name(tok) or _glued_labels(tok) or [tok]
    return out


def _glued_labels(tok: str) -> list[str]:
    """``NV12NV12SYS`` -> its labels; [] when the token is not made of labels only."""
    if not re.fullmatch(f"(?:{_LABELS.pattern})+", tok):
        return []
    return _LABELS.findall(tok)


def _glued_row_name(tok: str) -> list[str]:
    """``GPU1NV4`` -> [GPU1, NV4]: a device name glued to the labels after it."""
    match = re.fullmatch(rf"({_DEVICE.pattern})((?:{_LABELS.pattern})+)", tok)
    return [match.group(1), *_LABELS.findall(match.group(2))] if match else []


def _label_run(tokens: list[str]) -> list[str]:
    """The labels right after a row's name, up to the first token that is no label."""
    run = []
    for tok in tokens[1:]:
        if not is_label(tok):
            break
        run.append(tok)
    return run


def _is_row(line: str) -> bool:
    """A matrix row: a device name, then labels with exactly one X (its own column)."""
    tokens = _tokens(line)
    if not tokens or is_label(tokens[0]) or _EXTRA.match(line.strip()):
        return False
    run = _label_run(tokens)
    return run.count("X") == 1


def _first_row(lines: list[str]) -> int | None:
    return next((i for i, line in enumerate(lines) if _is_row(line)), None)


def _header_above(lines: list[str], first: int | None) -> int | None:
    """The line of column names: the last non-blank line above the first row, when it starts
    with GPU0 as every nvidia-smi header does (any such line when there are no rows)."""
    if first is None:
        return next((i for i, line in enumerate(lines) if _is_header(line)), None)
    for i in range(first - 1, -1, -1):
        if lines[i].strip():
            return i if _is_header(lines[i]) else None
    return None


def _is_header(line: str) -> bool:
    return line.lstrip().startswith("GPU0") and not _is_row(line)


def _columns(lines: list[str], header: int | None, first: int,
             notes: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Device columns and the extra columns' names, from the header where it is sound, else
    from the rows (each row's X stands in its own column)."""
    block = []
    for line in lines[first:]:
        if not _is_row(line):
            break
        block.append(_tokens(line))
    width = len(_label_run(block[0]))
    by_rows: dict[int, str] = {}
    for tokens in block:
        run = _label_run(tokens)
        if len(run) == width:
            by_rows.setdefault(run.index("X"), tokens[0])
    text = lines[header] if header is not None else ""
    devices_text, extras = _split_header(text)
    plain = devices_text.split()
    if header is not None and _agrees(plain, by_rows):
        return tuple(plain), extras
    split = [name for tok in plain for name in (_DEVICE.findall(tok) or [tok])]
    if header is not None and len(split) == width and _agrees(split, by_rows):
        notes.append(f"the header had lost separators between its column names "
                     f"({_quote(devices_text)}): read as {' '.join(split)}")
        return tuple(split), extras
    columns = _from_rows(by_rows, width, notes)
    if header is None:
        values = max(len(tokens) - 1 - width for tokens in block)
        extras = DEFAULT_EXTRAS[:values] + tuple(
            f"COL{width + k}" for k in range(len(DEFAULT_EXTRAS), values))
        notes.append("no header line above the matrix: the columns are named after the row "
                     f"labels ({' '.join(columns)})"
                     + (f" and the values after the matrix are taken as {', '.join(extras)}, "
                        "in nvidia-smi's order" if extras else ""))
    else:
        notes.append(f"the header ({_quote(text)}) does not match the rows: the columns are "
                     f"named after the row labels: {' '.join(columns)}")
    return columns, extras


def _agrees(names: list[str], by_rows: dict[int, str]) -> bool:
    """The header names each printed row's own column (where its X stands), and no name twice."""
    return (bool(names) and len(set(names)) == len(names)
            and all(p < len(names) and names[p] == name for p, name in by_rows.items()))


def _from_rows(by_rows: dict[int, str], width: int, notes: list[str]) -> tuple[str, ...]:
    """Column names from the rows; columns no row shows continue the numbering before them."""
    names: list[str] = []
    guessed = []
    for p in range(width):
        if p in by_rows:
            names.append(by_rows[p])
            continue
        prev = _NUMBERED.match(names[-1]) if names else None
        name = f"{prev.group(1)}{int(prev.group(2)) + 1}" if prev else f"COL{p}"
        names.append(name)
        guessed.append(name)
    if guessed:
        notes.append(f"no row and no readable header name columns {', '.join(guessed)}: "
                     "named by continuing the numbering of the column before each")
    return tuple(names)


def _split_header(header: str) -> tuple[str, tuple[str, ...]]:
    """The header's device part (text), and the names of the columns after the matrix."""
    found = list(_EXTRA.finditer(header))
    if not found:
        return header, ()
    devices = header[:found[0].start()]
    extras: list[str] = []
    pos = found[0].start()
    for match in found:
        extras += _unknown(header[pos:match.start()])
        extras.append(match.group(0))
        pos = match.end()
    extras += _unknown(header[pos:])
    return devices, tuple(extras)


def _unknown(text: str) -> list[str]:
    """Names of columns gpucoll does not know, separated by tabs or runs of spaces."""
    return [x.strip() for x in re.split(r"\t+| {2,}", text) if x.strip()]


def _quote(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _parse_row(line: str, columns: tuple[str, ...], extra_columns: tuple[str, ...],
               source: str, lineno: int) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """One matrix row: its name, its labels, and its extra values by column name.

    Values never contain blanks, so splitting on whitespace gives the cells, except that a
    blank cell vanishes. nvidia-smi prints N/A for unknown NUMA values but leaves an unknown CPU
    affinity blank, so missing values are the leading ones: the present ones are right-aligned.
    """
    tokens = _tokens(line)
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


def _infer_nic_legend(columns: tuple[str, ...], nic_legend: dict[str, str],
                      notes: list[str]) -> None:
    """Complete a NIC legend cut short when every entry it has follows one pattern
    (NICk: mlx5_k), and say so; otherwise leave the missing NICs unnamed."""
    nics = [c for c in columns if re.fullmatch(r"NIC\d+", c)]
    missing = [n for n in nics if n not in nic_legend]
    if not nic_legend or not missing:
        return
    offsets, prefixes = set(), set()
    for nic, device in nic_legend.items():
        match = _NUMBERED.match(device)
        if not match:
            return
        prefixes.add(match.group(1))
        offsets.add(int(match.group(2)) - int(nic[3:]))
    if len(prefixes) != 1 or len(offsets) != 1:
        return
    prefix, offset = prefixes.pop(), offsets.pop()
    for nic in missing:
        nic_legend[nic] = f"{prefix}{int(nic[3:]) + offset}"
    notes.append(f"the NIC legend stops short of {', '.join(missing)}: named "
                 f"{', '.join(nic_legend[n] for n in missing)} after the pattern of the "
                 "entries it has")


def observed_from_smi(smi: SmiFacts) -> Observed:
    """Devices and labels of a saved nvidia-smi output; a missing row is filled from the
    columns of the printed rows (the matrix is symmetric), else left None."""
    devices = tuple(_smi_device(smi, name) for name in smi.columns)
    matrix = {a: {b: _smi_cell(smi, a, b) for b in smi.columns} for a in smi.columns}
    missing = [name for name in smi.columns if name not in smi.rows]
    notes = tuple(Finding("inferred", f"read from a damaged copy: {note}") for note in smi.notes)
    if missing:
        notes += (Finding("partial", f"the output lacks the rows of {', '.join(missing)}: "
                          "their cells come from the other rows' columns where printed, and "
                          "their CPU affinity is unknown", tuple(missing)),)
    return Observed("nvidia-smi", smi.source, devices, matrix, None, notes)


def _smi_cell(smi: SmiFacts, a: str, b: str) -> str | None:
    if a == b:
        return "X"
    if a in smi.rows:
        return smi.rows[a][smi.columns.index(b)]
    if b in smi.rows:
        return smi.rows[b][smi.columns.index(a)]
    return None


def _smi_device(smi: SmiFacts, name: str) -> Device:
    extras = smi.extras.get(name, {})
    gpu = re.fullmatch(r"GPU(\d+)", name)
    if gpu:
        kind, index, legend = "gpu", int(gpu.group(1)), None
    else:
        nics = [c for c in smi.columns if not re.fullmatch(r"GPU\d+", c)]
        kind, index = "nic", nics.index(name)
        legend = smi.nic_legend.get(name, None if re.fullmatch(r"NIC\d+", name) else name)
    return Device(name=name, kind=kind, index=index, device=legend,
                  cpu_affinity=extras.get("CPU Affinity") or None,
                  numa_affinity=extras.get("NUMA Affinity") or extras.get("NUMA ID") or None,
                  gpu_numa_id=extras.get("GPU NUMA ID") or None)
