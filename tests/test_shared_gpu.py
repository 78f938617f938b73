"""backend="nccl" with several ranks on one GPU, on the emulation: NCCL before 2.30 is given a
distinct NCCL_HOSTID per rank, NCCL from 2.30 NCCL_MULTI_RANK_GPU_ENABLE=1; the run says so once;
auto keeps the host ring there and says that backend="nccl" runs NCCL."""

from __future__ import annotations

import hazard_ranks
import nccl_ranks
import pytest
from multiproc import spawn
from nccl_emulation import EmulatedRuntime

from gpucoll.backends.nccl.backend import decide, shared_gpu_settings
from gpucoll.errors import BackendUnavailable

pytestmark = pytest.mark.timeout(120)

CLEAN = {"NCCL_HOSTID": "", "NCCL_MULTI_RANK_GPU_ENABLE": "", "NCCL_NVLS_ENABLE": "",
         "GPUCOLL_BACKEND": ""}


def test_two_ranks_on_one_gpu_before_nccl_2_30_get_distinct_host_ids(store_addr):
    got = spawn(nccl_ranks.on_one_gpu, 2, store_addr, "2.28.9", env=CLEAN, timeout=90)
    envs = [env for env, _ in got]
    assert all(set(env) == {"NCCL_HOSTID"} for env in envs)
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    line = got[0][1]
    assert line.count("\n") == 1 and "ranks 0, 1 share GPU" in line
    assert "NCCL 2.28.9" in line and "NCCL_HOSTID" in line
    assert got[1][1] == ""


def test_two_ranks_on_one_gpu_from_nccl_2_30_enable_multi_rank_gpu(store_addr):
    got = spawn(nccl_ranks.on_one_gpu, 2, store_addr, "2.30.3", env=CLEAN, timeout=90)
    assert [env for env, _ in got] == [{"NCCL_MULTI_RANK_GPU_ENABLE": "1"}] * 2
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in got[0][1] and got[0][1].count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.28.9", "2.32.3"])
def test_four_ranks_on_one_gpu_run_the_collectives(store_addr, version):
    got = spawn(nccl_ranks.on_one_gpu, 4, store_addr, version, env=CLEAN, timeout=110)
    assert "ranks 0, 1, 2, 3 share GPU" in got[0][1]
    if version < "2.30":
        assert len({env["NCCL_HOSTID"] for env, _ in got}) == 4


def test_one_user_set_host_id_for_ranks_on_one_gpu_is_refused_before_nccl_starts(store_addr):
    got = spawn(nccl_ranks.refused_on_one_gpu, 2, store_addr, "2.28.9", timeout=90,
                env={**CLEAN, "NCCL_HOSTID": "same"})
    for rank, err in enumerate(got):
        assert err.startswith("BackendUnavailable"), err
        assert f"rank {rank}:" in err and "ranks 0, 1 share GPU" in err and "'same'" in err


def test_user_set_host_ids_that_differ_are_kept():
    settings, line = shared_gpu_settings("2.28.9", ["h/a", "h/a"], 0, {"NCCL_HOSTID": "x"},
                                         hostids=["x", "y"])
    assert settings == {} and "the user's where set" in line


def test_multi_rank_gpu_enable_0_is_refused_before_nccl_starts(store_addr):
    got = spawn(nccl_ranks.refused_on_one_gpu, 2, store_addr, "2.32.3", timeout=90,
                env={**CLEAN, "NCCL_MULTI_RANK_GPU_ENABLE": "0"})
    for rank, err in enumerate(got):
        assert err.startswith("BackendUnavailable"), err
        assert f"rank {rank}" in err and "NCCL_MULTI_RANK_GPU_ENABLE=1" in err and "'0'" in err


def test_ranks_on_different_gpus_of_one_host_keep_one_host_id():
    gpus = ["h/a", "h/b", "h/a", "h/b"]
    ids = [shared_gpu_settings("2.28.9", gpus, r, {})[0]["NCCL_HOSTID"] for r in range(4)]
    assert ids[0] == ids[1] != ids[2] == ids[3]


def test_nvls_forced_on_is_refused_where_ranks_share_a_gpu():
    with pytest.raises(BackendUnavailable, match="NCCL_NVLS_ENABLE=1"):
        shared_gpu_settings("2.32.3", ["h/a", "h/a"], 1, {"NCCL_NVLS_ENABLE": "1"})


def test_auto_keeps_the_ring_for_ranks_sharing_a_gpu_and_names_backend_nccl():
    verdicts = [{"ok": True, "why": "ok", "gpu": "h/a"}] * 2
    name, reason = decide(verdicts, 0)
    assert name == "ring"
    assert "ranks 0, 1 would share GPU h/a" in reason and "backend='nccl' runs NCCL" in reason


def test_auto_on_one_gpu_runs_the_ring_even_with_multi_rank_gpu_enabled(store_addr):
    got = spawn(hazard_ranks.auto_on_one_gpu, 2, store_addr, timeout=60,
                env={**CLEAN, "NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    for name, reason, total in got:
        assert (name, total) == ("ring", 3.0)
        assert "backend='nccl' runs NCCL there" in reason


def test_the_emulation_reports_the_version_it_is_told(store_addr):
    rt = EmulatedRuntime(store_addr, devices=1, nccl_version="2.28.9")
    try:
        assert str(rt.nccl().get_version().libnccl.version) == "2.28.9"
        assert rt.nccl().older_than(2, 30)
    finally:
        rt.close()


@pytest.mark.parametrize(("version", "hostids", "ok"), [
    ("2.28.9", ["", ""], False),      # one host, one GPU: "Duplicate GPU detected"
    ("2.28.9", ["a", "a"], False),
    ("2.28.9", ["a", "b"], True),     # separate hosts to NCCL
    ("2.32.3", ["a", "b"], False),    # from 2.30 only NCCL_MULTI_RANK_GPU_ENABLE=1 allows it
])
def test_the_emulation_refuses_ranks_on_one_gpu_as_nccl_does(store_addr, version, hostids, ok):
    got = spawn(nccl_ranks.raw_init_on_one_gpu, 2, store_addr, version, hostids, timeout=60,
                env=CLEAN)
    if ok:
        assert got == ["ok", "ok"]
    else:
        assert all(g.startswith("NCCLError: InvalidUsage") for g in got), got
