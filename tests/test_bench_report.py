"""Our table reads like nccl-tests' own: a parser written for nccl-tests logs reads it unchanged.

``parse_log`` below is written from nccl-tests' src/common.cu output format only (data lines
are 5 fixed fields then 4 per placement; ``#`` lines are comments; the footer's two figures),
and is first checked against a log in nccl-tests' exact layout.
"""

from __future__ import annotations

import csv
import json
import re

import pytest

from gpucoll.bench import report
from gpucoll.bench.cli import Console, EventFile, replay
from gpucoll.bench.engine import Measurement, Result
from gpucoll.bench.options import parse_args

NCCL_TESTS_LOG = """\
# nThread 1 nGpus 2 minBytes 8 maxBytes 1024 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   2748 on     qualid device  0 [0000:01:00] NVIDIA GeForce RTX 4070
#  Rank  1 Group  0 Pid   2748 on     qualid device  1 [0000:03:00] NVIDIA GeForce RTX 4070
#
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong 
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         
           8             2     float     sum      -1     6.21    0.00    0.00       0     6.23    0.00    0.00       0
          64            16     float     sum      -1     6.28    0.01    0.01       0     6.30    0.01    0.01       0
        1024           256     float     sum      -1     7.01    0.15    0.15       0     6.78    0.15    0.15       0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.0516667 
#
"""  # noqa: E501, W291

FIELDS = ("size", "count", "type", "redop", "root")
CELLS = ("time", "algbw", "busbw", "wrong")


def _num(text: str):
    if text == "N/A":
        return None
    return float(text)


def parse_log(text: str) -> dict:
    """Rows and footer of an nccl-tests log (the layout of its src/common.cu)."""
    rows, footer = [], {}
    for line in text.splitlines():
        if line.startswith("#"):
            m = re.match(r"#\s*(Out of bounds values|Avg bus bandwidth)\s*:\s*(\S+)", line)
            if m:
                footer[m.group(1)] = float(m.group(2))
            continue
        parts = line.split()
        if len(parts) != 13:
            continue
        row = dict(zip(FIELDS, parts[:5], strict=True))
        row["size"], row["count"], row["root"] = int(row["size"]), int(row["count"]), int(
            row["root"])
        row["out_of_place"] = dict(zip(CELLS, map(_num, parts[5:9]), strict=True))
        row["in_place"] = dict(zip(CELLS, map(_num, parts[9:13]), strict=True))
        rows.append(row)
    return {"rows": rows, "footer": footer}


def _result(size=1024, oop=(7.0, 0.15, 0.15, 0), ip=(6.5, 0.16, 0.16, 0), op="all_reduce"):
    return Result(op, size, size // 4, "float", "sum", -1,
                  None if oop is None else Measurement(*oop),
                  None if ip is None else Measurement(*ip))


def test_the_parser_reads_a_log_in_nccl_tests_layout():
    log = parse_log(NCCL_TESTS_LOG)
    assert [r["size"] for r in log["rows"]] == [8, 64, 1024]
    assert log["rows"][2]["in_place"] == {"time": 6.78, "algbw": 0.15, "busbw": 0.15,
                                          "wrong": 0}
    assert log["footer"] == {"Out of bounds values": 0, "Avg bus bandwidth": 0.0516667}


def test_our_column_heads_are_nccl_tests_column_heads():
    ours = report.table_head()
    theirs = NCCL_TESTS_LOG.splitlines()[6:9]
    assert [line.rstrip() for line in ours] == [line.rstrip() for line in theirs]


def test_the_parser_reads_our_rows_and_footer():
    results = [_result(8, (6.21, 0.0, 0.0, 0), (6.23, 0.0, 0.0, 0)),
               _result(1024, (7.01, 0.146, 0.146, 0), (6.78, 0.151, 0.151, 0))]
    text = "\n".join(report.table_head() + [report.table_row(r) for r in results]
                     + report.table_footer(results))
    log = parse_log(text)
    assert [(r["size"], r["count"], r["type"], r["redop"], r["root"]) for r in log["rows"]] == [
        (8, 2, "float", "sum", -1), (1024, 256, "float", "sum", -1)]
    assert log["rows"][1]["out_of_place"] == {"time": 7.01, "algbw": 0.15, "busbw": 0.15,
                                              "wrong": 0}
    assert log["footer"]["Out of bounds values"] == 0
    assert log["footer"]["Avg bus bandwidth"] == pytest.approx((0.146 + 0.151) / 4, rel=1e-4)


def test_our_rows_line_up_with_nccl_tests_rows():
    ours = report.table_row(_result(1024, (7.01, 0.15, 0.15, 0), (6.78, 0.15, 0.15, 0)))
    theirs = NCCL_TESTS_LOG.splitlines()[11]
    assert ours == theirs


def test_a_placement_the_library_lacks_prints_na_in_every_column():
    row = report.table_row(_result(oop=None))
    log = parse_log(row)
    assert log["rows"][0]["out_of_place"] == dict.fromkeys(CELLS)
    assert log["rows"][0]["in_place"]["time"] == 6.5


def test_wrong_elements_fail_the_footer():
    bad = [_result(ip=(6.5, 0.16, 0.16, 12))]
    footer = report.table_footer(bad)
    assert footer[0] == "# Out of bounds values : 1 FAILED"
    assert parse_log("\n".join(footer))["footer"]["Out of bounds values"] == 1


@pytest.mark.parametrize("value,width,text", [(6.2123, 7, "   6.21"), (12345.6, 7, "12345.6"),
                                              (123456.0, 7, " 123456"),
                                              (98765432.0, 7, "9.9e+07"), (0.0, 6, "  0.00")])
def test_numbers_keep_their_column_width_like_nccl_tests(value, width, text):
    assert report.float_str(value, width) == text


def _console(tmp_path, argv):
    opts = parse_args(argv + ["--json", str(tmp_path / "r.json"), "--csv",
                              str(tmp_path / "r.csv")])
    return Console(opts, argv, out=open(tmp_path / "out.txt", "w"))


def _run(console, library, results):
    console.start({"library": library, "backend": "x", "transport": "y", "ranks": 2,
                   "memory": "host", "versions": {"numpy": "2"}, "devices": ["1 h cpu"]})
    for r in results:
        console.result(r)
    console.finish(None)


def test_events_written_by_rank_zero_replay_into_the_same_table(tmp_path):
    events = EventFile(str(tmp_path / "events.jsonl"))
    events.start({"library": "gpucoll", "ranks": 2, "devices": []})
    events.result(_result())
    events.finish(None)
    console = _console(tmp_path, [])
    kinds = [replay(line, console) for line in open(tmp_path / "events.jsonl")]
    assert kinds == ["start", "result", "finish"]
    assert console.runs[0]["results"] == [_result().to_json()]


def test_json_and_csv_hold_every_measured_cell(tmp_path):
    console = _console(tmp_path, ["-b", "8"])
    _run(console, "gpucoll", [_result(8), _result(1024, oop=None)])
    _run(console, "gloo", [_result(8), _result(1024)])
    assert console.close() == 0
    doc = json.load(open(tmp_path / "r.json"))
    assert [run["library"] for run in doc["runs"]] == ["gpucoll", "gloo"]
    assert doc["runs"][0]["results"][1]["out_of_place"] is None
    assert doc["runs"][1]["results"][1]["in_place"]["bus_bw"] == 0.16
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == 7  # 3 cells of gpucoll + 4 of gloo
    assert {r["placement"] for r in rows} == {"out_of_place", "in_place"}


def test_peers_get_a_side_by_side_comparison(tmp_path):
    console = _console(tmp_path, [])
    _run(console, "gpucoll", [_result(8, ip=(20.0, 0.0, 0.0, 0))])
    _run(console, "gloo", [_result(8, ip=(250.0, 0.0, 0.0, 0))])
    lines = report.comparison(console.runs, "all_reduce")
    assert "gpucoll" in lines[1] and "gloo" in lines[1]
    assert lines[3].split()[:4] == ["8", "20.00", "0.00", "250.00"]


def test_a_wrong_result_makes_the_run_fail(tmp_path):
    console = _console(tmp_path, [])
    _run(console, "gpucoll", [_result(ip=(6.5, 0.16, 0.16, 3))])
    assert console.close() == 1


def test_each_table_ends_with_its_peak_beside_the_host_copy_ceiling():
    results = [_result(8, ip=(6.0, 0.0, 0.0, 0)), _result(1 << 20, ip=(100.0, 10.5, 10.5, 0))]
    line = report.peak_line(results, [{"name": "host memcpy", "GBps": 21.0}])
    assert line == ("# Peak busbw: 10.50 GB/s at 1 MiB, 50% of the host memcpy ceiling "
                    "(21.00 GB/s)")
    assert report.peak_line(results, []) is None


def test_no_peak_line_where_the_host_copy_is_no_bound_or_nothing_crossed_a_link():
    results = [_result(8, ip=(6.0, 0.0, 0.0, 0)), _result(1 << 20, ip=(100.0, 10.5, 10.5, 0))]
    ceilings = [{"name": "host memcpy", "GBps": 21.0}]
    assert report.peak_line(results, ceilings, "device") is None
    one_rank = [_result(1 << 20, oop=None, ip=(80.0, 13.1, 0.0, 0))]  # one rank: busbw 0
    assert report.peak_line(one_rank, ceilings) is None
