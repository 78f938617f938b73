"""benchmarks/collectives.py: a thin sweep over `gpucoll bench` that judges the ring's targets."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from gpucoll.bench.options import parse_args

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "collectives.py"
spec = importlib.util.spec_from_file_location("bench_collectives", PATH)
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def _row(size, time_us, busbw):
    cell = {"time": time_us, "alg_bw": busbw, "bus_bw": busbw, "nwrong": 0}
    return {"op": "all_reduce", "size": size, "count": size // 4, "type": "float",
            "redop": "sum", "root": -1, "out_of_place": None, "in_place": cell}


def _doc(**libs):
    return {"runs": [{"library": name, "ranks": 2, "results": rows}
                     for name, rows in libs.items()]}


def test_the_sweep_is_gpucoll_bench_with_peers_and_files_per_rank_count():
    argv = sweep.bench_argv(["all_reduce"], 4, "out/r.json", ["-n", "5"])
    opts = parse_args(argv)
    assert opts.ranks == 4 and opts.peers == ("gloo", "mpi") and opts.iters == 5
    assert (opts.minbytes, opts.maxbytes, opts.dtypes) == (8, 128 << 20, ("float",))
    assert opts.json == "out/r.json"


def test_two_rank_targets_are_judged_from_the_measured_numbers():
    mib32 = 32 << 20
    doc = _doc(gpucoll=[_row(8, 6.0, 0.0), _row(mib32, 9000.0, 7.5)],
               gloo=[_row(8, 250.0, 0.0), _row(mib32, 40000.0, 1.5)],
               mpi=[_row(8, 1.0, 0.0), _row(mib32, 12000.0, 6.0)])
    lines = sweep.check_targets(doc, 2)
    assert lines[0] == "all_reduce at 8 B: time <= 8x Open MPI's: worst 6.00x at 8 B, " \
                       "1/1 sizes: met"
    assert lines[1].startswith("all_reduce at 8 B: time <= 0.03x gloo's: worst 0.02x")
    assert lines[2].endswith("not measured")  # no 64 KiB-4 MiB sizes in the document
    assert lines[3] == "all_reduce from 16 MiB: busbw >= 1.3x Open MPI's: worst 1.25x at " \
                       "32 MiB, 0/1 sizes (missed at 32 MiB): NOT met"
    assert lines[4].endswith("worst 5.00x at 32 MiB, 1/1 sizes: met")


def test_each_target_says_in_how_many_rounds_it_was_met():
    rounds = [_doc(gpucoll=[_row(8, t, 0.0)], mpi=[_row(8, 1.0, 0.0)]) for t in (7.0, 9.0, 7.5)]
    merged = sweep.median_doc(rounds)
    line = sweep.check_targets(merged, 2, rounds)[0]
    assert line == "all_reduce at 8 B: time <= 8x Open MPI's: worst 7.50x at 8 B, 1/1 sizes: " \
                   "met (met in 2 of 3 rounds)"
    assert sweep.check_targets(merged, 2, rounds[:1])[0].endswith("1/1 sizes: met")  # one round


def test_four_ranks_must_never_be_slower_than_gloo():
    doc = _doc(gpucoll=[_row(8, 30.0, 0.0), _row(64, 500.0, 0.0)],
               gloo=[_row(8, 700.0, 0.0), _row(64, 400.0, 0.0)])
    never_slower = [line for line in sweep.check_targets(doc, 4) if "gloo" in line]
    assert never_slower == ["all_reduce at every size: time <= 1x gloo's: worst 1.25x at 64 B, "
                            "1/2 sizes (missed at 64 B): NOT met"]


def test_a_peer_that_did_not_run_leaves_its_target_unjudged():
    doc = _doc(gpucoll=[_row(8, 20.0, 0.0)])
    assert all(line.endswith("not measured") for line in sweep.check_targets(doc, 2))
    assert all(line.endswith("not measured") for line in sweep.check_targets(doc, 4))


def test_rounds_merge_into_median_times_with_bandwidths_recomputed():
    mib = 1 << 20
    docs = [_doc(gpucoll=[_row(mib, t, 0.0)], gloo=[_row(mib, 10 * t, 0.0)])
            for t in (100.0, 300.0, 200.0)]
    docs[1]["runs"][0]["results"][0]["in_place"]["nwrong"] = 2
    merged = sweep.median_doc(docs)
    ours = merged["runs"][0]["results"][0]["in_place"]
    assert ours["time"] == 200.0 and ours["nwrong"] == 2
    assert ours["alg_bw"] == mib / 200e-6 / 1e9 and ours["bus_bw"] == ours["alg_bw"]  # 2 ranks
    assert merged["runs"][1]["results"][0]["in_place"]["time"] == 2000.0
    assert merged["rounds"] == 3


@pytest.mark.slow
def test_steadiness_runs_the_same_sweep_twice_and_compares_them_size_by_size(capsys, tmp_path):
    path = PATH.parent / "steadiness.py"
    spec_ = importlib.util.spec_from_file_location("bench_steadiness", path)
    steady = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(steady)
    out = tmp_path / "s.json"
    assert steady.main(["--rounds", "1", "--low", "64K", "--high", "256K", "--out", str(out),
                        "--", "--time", "0.05", "--loops", "2", "-c", "0"]) == 0
    text = capsys.readouterr().out
    assert "65536" in text and "262144" in text and "# worst difference" in text
    import json

    (rnd,) = json.loads(out.read_text())["rounds"]
    assert set(rnd["first"]) == set(rnd["second"]) == {"65536", "262144"}
    assert steady.differ(100.0, 110.0) == pytest.approx(10 / 105)
