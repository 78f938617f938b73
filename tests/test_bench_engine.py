"""The sweep engine: one table line per case, timings combined over ranks, wrong data counted.

The single-process tests drive the engine through a one-rank library written here with NumPy;
the multi-process ones run the real communicator on 2 ranks and read the printed table back
with the nccl-tests log parser.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from multiproc import spawn
from test_bench_report import parse_log

from gpucoll.bench.engine import Case, Engine, HostMemory, case_total, cases, combine, placed
from gpucoll.bench.options import parse_args


class OneRank:
    """A library of one rank: every collective is a copy (what it is on one rank)."""

    name, rank, size = "one", 0, 1

    def __init__(self, broken: str = "", no_in_place: str = ""):
        self.broken, self.no_in_place, self.calls = broken, no_in_place, {}

    def describe(self):
        return {"library": self.name}

    def prepare(self, op, send, recv, redop, root, in_place):
        if in_place and op == self.no_in_place:
            return None

        def call():
            self.calls[op] = self.calls.get(op, 0) + 1
            if send is not recv:
                recv[...] = send  # NumPy or CuPy
            if op == self.broken and recv.size:
                recv[0] = 99

        return call

    def barrier(self):
        pass

    def close(self):
        pass


def _engine(lib, argv):
    return Engine(lib, HostMemory(), parse_args(argv))


def test_a_correct_library_gets_no_wrong_elements():
    r = _engine(OneRank(), ["-n", "3", "-w", "1"]).run(Case("all_reduce", 64, "float", "sum", -1))
    assert (r.size, r.count, r.type, r.redop, r.root) == (64, 16, "float", "sum", -1)
    assert r.out_of_place.wrong == 0 and r.in_place.wrong == 0
    assert r.in_place.time_us > 0


def test_a_library_that_corrupts_data_is_caught_by_the_check_pass():
    r = _engine(OneRank(broken="all_gather"), []).run(Case("all_gather", 64, "int32", "none",
                                                            -1))
    assert r.out_of_place.wrong == 1


def test_check_zero_skips_the_correctness_pass():
    r = _engine(OneRank(broken="all_reduce"), ["-c", "0"]).run(
        Case("all_reduce", 64, "float", "sum", -1))
    assert r.in_place.wrong is None


def test_with_n_every_loop_runs_n_calls_after_w_warm_up_calls_then_the_checks():
    lib = OneRank(no_in_place="broadcast")
    _engine(lib, ["-w", "4", "-n", "7", "--loops", "3", "-c", "2"]).run(
        Case("broadcast", 8, "float", "none", 0))
    # out of place only: 4 warm-up + 3 loops of 7 timed + 2 checks
    assert lib.calls["broadcast"] == 4 + 3 * 7 + 2
    # the engine's own sums over ranks (the loop times, the wrong count) use the library too
    assert lib.calls["all_reduce"] == 2


class Paced(OneRank):
    """A one-rank library whose every call advances a fake clock by ``seconds``."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.now = seconds, 0.0

    def prepare(self, op, send, recv, redop, root, in_place):
        call = super().prepare(op, send, recv, redop, root, in_place)
        if call is None:
            return None

        def paced():
            call()
            if op == "broadcast":
                self.now += self.seconds

        return paced


class FakeClockMemory(HostMemory):
    def __init__(self, lib):
        self.lib = lib

    def timer(self):
        lib = self.lib

        class Timer:
            def start(self):
                self.t0 = lib.now

            def stop(self):
                return lib.now - self.t0

        return Timer()


def _paced_run(seconds, argv):
    lib = Paced(seconds)
    lib.no_in_place = "broadcast"
    engine = Engine(lib, FakeClockMemory(lib), parse_args(argv))
    return lib, engine.run(Case("broadcast", 8, "float", "none", 0))


def test_without_n_the_loops_hold_as_many_calls_as_fill_the_time():
    # 1 ms a call; 0.1 s of timed calls in 5 loops -> 20 calls a loop; warm-up of 0.05 s
    lib, r = _paced_run(1e-3, ["--time", "0.1", "--loops", "5", "--warmup-time", "0.05",
                               "-w", "2", "-c", "0"])
    m = r.out_of_place
    assert (m.iters, m.loops) == (20, 5)
    assert lib.calls["broadcast"] == 1 + 50 + 5 * 20  # pace probe, warm-up, loops
    assert m.time_us == pytest.approx(1000.0) and m.median_us == pytest.approx(1000.0)


def test_a_slow_call_still_gets_the_minimum_warm_up_and_one_call_a_loop():
    lib, r = _paced_run(2.0, ["--time", "0.1", "--loops", "3", "-w", "2", "-c", "0"])
    assert (r.out_of_place.iters, r.out_of_place.loops) == (1, 3)
    assert lib.calls["broadcast"] == 1 + 2 + 3


def test_no_warm_up_at_all_takes_the_pace_from_the_first_call():
    lib, r = _paced_run(1e-3, ["--time", "0.01", "--loops", "2", "--warmup-time", "0",
                               "-w", "0", "-c", "0"])
    assert (r.out_of_place.iters, lib.calls["broadcast"]) == (5, 1 + 2 * 5)


def test_the_mean_median_and_spread_come_from_the_loops():
    from gpucoll.bench.engine import Timing

    t = Timing((1.0, 1.0, 4.0), iters=10)
    assert (t.mean, t.median) == (2.0, 1.0)


def test_measurements_keep_median_spread_and_counts_through_json():
    from gpucoll.bench.engine import Measurement

    m = Measurement(2.0, 1.0, 1.0, 0, median_us=1.5, min_us=1.0, max_us=4.0, iters=7, loops=3)
    assert Measurement.from_json(m.to_json()) == m
    assert m.spread == pytest.approx(2.0)
    assert Measurement.from_json({"time": 1.0, "alg_bw": 1.0, "bus_bw": 1.0,
                                  "nwrong": 0}).spread is None  # files of older versions


def test_a_form_the_library_lacks_is_reported_as_not_measured():
    r = _engine(OneRank(no_in_place="reduce"), []).run(Case("reduce", 8, "float", "sum", 0))
    assert r.in_place is None and r.out_of_place is not None


def test_zero_byte_sizes_still_run_like_nccl_tests():
    r = _engine(OneRank(), []).run(Case("all_to_all", 2, "float", "none", -1))
    assert (r.size, r.count, r.out_of_place.algbw) == (0, 0, 0.0)


def test_in_place_buffers_alias_as_nccl_defines_them():
    send, recv = np.zeros(8), np.zeros(8)
    s, r = placed("all_gather", send, recv, 1, 4, True)
    assert np.shares_memory(s, recv) and s.size == 2 and s.__array_interface__["data"][0] == (
        recv[2:].__array_interface__["data"][0])
    s, r = placed("reduce_scatter", send, recv, 3, 4, True)
    assert r.size == 2 and np.shares_memory(r, send[6:])
    s, r = placed("all_reduce", send, recv, 0, 4, True)
    assert s is recv and r is recv


@pytest.mark.gpu
def test_device_buffers_are_timed_with_cuda_events_and_checked():
    from gpucoll.bench.engine import CudaEventTimer, DeviceMemory

    mem = DeviceMemory()
    assert isinstance(mem.timer(), CudaEventTimer)
    engine = Engine(OneRank(broken="all_gather"), mem, parse_args(["-n", "3"]))
    good = engine.run(Case("all_reduce", 1 << 20, "float", "sum", -1))
    bad = engine.run(Case("all_gather", 1 << 20, "float", "none", -1))
    assert good.in_place.wrong == 0 and good.in_place.time_us > 0
    assert bad.out_of_place.wrong == 1


@pytest.mark.parametrize("mode,value", [(0, 3.0), (1, 2.0), (2, 1.0), (3, 3.0)])
def test_times_combine_over_ranks_as_nccl_tests_average_flag(mode, value):
    assert combine(np.array([3.0, 1.0, 2.0]), mode) == value


def test_cases_skip_operators_a_type_cannot_take():
    listed = list(cases(parse_args("all_reduce broadcast -d int32 -o avg,sum -r all -b 8 -e 16 "
                                   "-f 2".split()), 2))
    skipped = [c for c in listed if isinstance(c, str)]
    assert len(skipped) == 1 and "avg" in skipped[0] and "int32" in skipped[0]
    run = [c for c in listed if isinstance(c, Case)]
    assert [(c.op, c.redop, c.root, c.nbytes) for c in run] == [
        ("all_reduce", "sum", -1, 8), ("all_reduce", "sum", -1, 16),
        ("broadcast", "none", 0, 8), ("broadcast", "none", 0, 16),
        ("broadcast", "none", 1, 8), ("broadcast", "none", 1, 16)]
    assert case_total(parse_args("all_reduce broadcast -d int32 -o avg,sum -r all -b 8 -e 16 "
                                 "-f 2".split()), 2) == 6


def test_sendrecv_on_one_rank_is_skipped_with_a_reason():
    assert list(cases(parse_args("sendrecv -b 8 -e 8".split()), 1)) == [
        "skipped sendrecv: a ring of sends needs at least 2 ranks"]


def test_a_root_beyond_the_ranks_is_skipped_with_a_reason():
    listed = list(cases(parse_args("reduce -r 5 -b 8 -e 8".split()), 2))
    assert listed == ["skipped reduce root 5: only 2 ranks"]


# -- the real communicator on 2 ranks ----------------------------------------------------

ALL = ["all", "-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-w", "1", "-d", "float,int32"]


def _sweep_rank(rank, n, addr, argv):
    import gpucoll
    from gpucoll.bench.cli import Console, sweep
    from gpucoll.bench.libraries import GpucollLibrary

    opts = parse_args(argv)
    out = io.StringIO()
    console = Console(opts, argv, out=out) if rank == 0 else None
    comm = gpucoll.init(rank=rank, world_size=n, store=addr, timeout=30)
    try:
        sweep(GpucollLibrary(comm), HostMemory(), opts, console)
    finally:
        comm.close()
    return (out.getvalue(), console.close()) if console else None


@pytest.mark.slow
def test_every_operation_runs_correctly_on_two_ranks(store_addr):
    text, status = spawn(_sweep_rank, 2, store_addr, ALL, timeout=90)[0]
    log = parse_log(text)
    assert status == 0
    # 7 ops x 2 types x 3 sizes (8, 512, 32K)
    assert len(log["rows"]) == 42
    for row in log["rows"]:
        cells = [row[p] for p in ("out_of_place", "in_place") if row[p]["time"] is not None]
        assert cells, row
        assert all(c["wrong"] == 0 for c in cells), row
    assert text.count("# Out of bounds values : 0 OK") == 7
    assert "# Library gpucoll: backend ring, transport " in text
    # all_reduce, broadcast and reduce (the rooted rows) fill both placements, as nccl-tests
    both = [r for r in log["rows"] if None not in (r["out_of_place"]["time"],
                                                    r["in_place"]["time"])]
    assert len(both) == 3 * 2 * 3 and all(r in both for r in log["rows"] if r["root"] >= 0)


def _uneven_rank(rank, n, addr):
    """Rank 1 pays an extra millisecond a call: its slower pace must set both ranks' counts."""
    import time

    import gpucoll
    from gpucoll.bench.libraries import GpucollLibrary

    comm = gpucoll.init(rank=rank, world_size=n, store=addr, timeout=30)
    try:
        lib = GpucollLibrary(comm)
        engine = Engine(lib, HostMemory(), parse_args(["--time", "0.2", "--loops", "4",
                                                       "--warmup-time", "0.05", "-c", "1"]))
        fn = lib.prepare("all_reduce", None, np.ones(256, np.float32), "sum", -1, True)
        if rank == 1:
            slow = fn

            def fn():
                time.sleep(1e-3)
                slow()

        timing = engine.time(fn)
        return timing.iters, len(timing.loops), timing.mean
    finally:
        comm.close()


def test_ranks_of_different_pace_agree_on_every_count(store_addr):
    (iters0, loops0, mean0), (iters1, loops1, mean1) = spawn(_uneven_rank, 2, store_addr,
                                                             timeout=90)
    assert (iters0, loops0) == (iters1, loops1) and loops0 == 4
    # the count fills the time at the slow rank's pace (>= 1 ms a call): at most 0.05 s / 1 ms
    assert 1 <= iters0 <= 50
    assert mean0 == mean1  # the loops' times are combined over ranks
