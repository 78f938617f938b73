"""`gpucoll bench` reads nccl-tests' flags with nccl-tests' meanings and defaults."""

from __future__ import annotations

import argparse

import pytest

from gpucoll.bench.options import (
    NCCL_TYPES,
    BenchOptions,
    numpy_dtype,
    parse_args,
    parse_size,
    rank_argv,
    type_name,
)


@pytest.mark.parametrize("text,value", [("8", 8), ("1K", 1024), ("64k", 65536),
                                        ("128M", 128 << 20), ("1G", 1 << 30),
                                        ("4MiB", 4 << 20), ("2MB", 2 << 20)])
def test_sizes_take_binary_suffixes_like_nccl_tests(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1.5M", "-8", "12Q", "M"])
def test_a_size_that_is_no_byte_count_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte count"):
        parse_size(text)


def test_defaults_are_nccl_tests_defaults():
    o = parse_args([])
    assert (o.minbytes, o.maxbytes, o.stepbytes, o.stepfactor) == (32 << 20, 32 << 20,
                                                                   1 << 20, 1)
    assert (o.warmup, o.check, o.average) == (5, 1, 1)
    assert (o.ops, o.dtypes, o.redops, o.roots) == (("all_reduce",), ("float",), ("sum",), (0,))


def test_by_default_the_iteration_count_is_chosen_by_time():
    o = parse_args([])
    assert o.iters is None and (o.time, o.loops, o.warmup_time) == (0.3, 5, 0.1)
    assert parse_args(["-n", "20"]).iters == 20  # nccl-tests' fixed count, on request


def test_factor_sweep_doubles_from_min_to_max():
    o = parse_args("-b 8 -e 128M -f 2".split())
    sizes = o.sizes()
    assert sizes[0] == 8 and sizes[-1] == 128 << 20 and len(sizes) == 25
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))


def test_step_sweep_adds_stepbytes():
    assert parse_args("-b 1M -e 3M -i 1M".split()).sizes() == [1 << 20, 2 << 20, 3 << 20]


def test_short_and_long_flags_mean_the_same():
    short = parse_args("-b 8 -e 1K -f 4 -n 7 -w 2 -c 0 -o max -d half -r 1 -a 3 -g 4".split())
    long_ = parse_args(("--minbytes 8 --maxbytes 1K --stepfactor 4 --iters 7 --warmup_iters 2 "
                        "--check 0 --op max --datatype half --root 1 --average 3 "
                        "--ngpus 4").split())
    assert short == long_
    assert (short.iters, short.warmup, short.check, short.redops, short.dtypes, short.roots,
            short.average, short.ranks) == (7, 2, 0, ("max",), ("half",), (1,), 3, 4)


def test_all_expands_ops_types_reductions_and_roots():
    o = parse_args("all -d all -o all -r all".split())
    assert o.ops == ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                     "all_to_all", "sendrecv")
    assert o.dtypes == tuple(NCCL_TYPES)
    assert o.redops == ("sum", "prod", "max", "min", "avg")
    assert o.roots is None


def test_operation_names_accept_nccl_tests_binary_names_and_commas():
    assert parse_args(["all_reduce_perf", "alltoall,sendrecv_perf"]).ops == (
        "all_reduce", "all_to_all", "sendrecv")


def test_numpy_names_and_nccl_names_are_one_type():
    assert parse_args(["-d", "float32"]).dtypes == ("float",)
    assert numpy_dtype("half").name == "float16"
    assert type_name(numpy_dtype("double")) == "double"
    assert type_name(numpy_dtype("int16")) == "int16"  # beyond NCCL: the host ring has it


def test_peers_flag_asks_for_both_peers_and_peer_for_one():
    assert parse_args(["--peers"]).peers == ("gloo", "mpi")
    assert parse_args(["--peer", "mpi"]).peers == ("mpi",)
    assert parse_args([]).peers == ()


@pytest.mark.parametrize("argv,words", [
    ("-b 1M -e 8", "larger than -e"),
    ("-t 2", "one rank per process"),
    ("-n 0", "-n/--iters 0"),
    ("-g 0", "at least one rank"),
    ("bogus_op", "'bogus_op' is not benchmarked"),
    ("-d complex512", "datatype 'complex512'"),
    ("-o mean", "not a reduce op"),
    ("-r x", "not a rank number"),
    ("--peer nccl", "expected gloo or mpi"),
    ("-i 0", "never advances"),
    ("--loops 0", "--loops 0: must be at least 1"),
    ("--time 0", "--time 0.0: must be a positive number of seconds"),
    ("--time nan", "--time nan: must be a positive"),
    ("--warmup-time -1", "--warmup-time -1.0: must be"),
])
def test_bad_flags_exit_with_usage_naming_the_problem(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv.split())
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("timing", ["-n 3", "--time 0.7 --loops 3 --warmup-time 0.15"])
def test_rank_argv_makes_ranks_read_the_same_sweep(timing):
    o = parse_args(f"all_gather broadcast -b 8 -e 1M -f 4 {timing} -w 1 -c 2 -o sum,max "
                   "-d int32 -r all -a 2 --transport tcp --timeout 9".split())
    again = parse_args(rank_argv(o))
    driver_only = {"json", "csv", "plot", "peers", "progress", "ranks", "ceilings"}
    for field in BenchOptions.__dataclass_fields__:
        if field not in driver_only:
            assert getattr(again, field) == getattr(o, field), field


def test_an_output_into_a_missing_directory_fails_before_measuring(tmp_path):
    from gpucoll.bench.options import check_outputs

    check_outputs(parse_args(["--json", str(tmp_path / "r.json")]))
    with pytest.raises(SystemExit, match="--plot .*: no such directory"):
        check_outputs(parse_args(["--plot", str(tmp_path / "nope" / "r.png")]))
