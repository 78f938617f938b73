"""Rendezvous from each launcher's environment, the Slurm hostlist, and connecting the store."""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time

import pytest
from multiproc import spawn

from gpucoll.errors import PeerFailure
from gpucoll.rendezvous import (
    DEFAULT_PORT,
    MAX_WORLD_SIZE,
    Rendezvous,
    RendezvousError,
    connect_store,
    expand_hostlist,
    from_env,
    job_id,
)


# ----------------------------------------------------------------------------- launchers
def test_gpucoll_launcher_environment_names_a_running_store():
    rdv = from_env({"GPUCOLL_RANK": "3", "GPUCOLL_WORLD_SIZE": "8", "GPUCOLL_LOCAL_RANK": "1",
                    "GPUCOLL_LOCAL_WORLD_SIZE": "2", "GPUCOLL_STORE": "tcp://node0:4000",
                    "GPUCOLL_STORE_TOKEN": "t", "RANK": "99"})
    assert rdv == Rendezvous(3, 8, 1, 2, "node0", 4000, True, "t", "gpucoll")


def test_gpucoll_master_addr_makes_rank_0_host_the_store():
    rdv = from_env({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "2",
                    "GPUCOLL_MASTER_ADDR": "10.0.0.1", "GPUCOLL_MASTER_PORT": "5000"})
    assert (rdv.store_host, rdv.store_port, rdv.store_is_running) == ("10.0.0.1", 5000, False)


def test_gpucoll_without_local_variables_means_one_host():
    rdv = from_env({"GPUCOLL_RANK": "2", "GPUCOLL_WORLD_SIZE": "4"})
    assert (rdv.local_rank, rdv.local_world_size) == (2, 4)
    assert (rdv.store_host, rdv.store_port) == ("127.0.0.1", DEFAULT_PORT)


def test_torchrun_environment_uses_the_port_after_master_port():
    rdv = from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "head", "MASTER_PORT": "29500"})
    assert rdv == Rendezvous(5, 8, 1, 4, "head", 29501, False, None, "torchrun")


def test_gpucoll_master_port_overrides_master_port():
    rdv = from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "1",
                    "GPUCOLL_MASTER_PORT": "7000"})
    assert rdv.store_port == 7000


def test_slurm_environment_meets_at_the_first_node_on_a_job_port():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}
    rdv = from_env(env)
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size) == (6, 8, 2, 4)
    assert (rdv.store_host, rdv.store_is_running, rdv.source) == ("gpu07", False, "slurm")
    assert 20000 <= rdv.store_port < 32000
    assert from_env({**env, "SLURM_PROCID": "0"}).store_port == rdv.store_port
    assert from_env({**env, "SLURM_JOB_ID": "4243"}).store_port != rdv.store_port


def test_slurm_uneven_tasks_per_node_gives_this_nodes_count():
    rdv = from_env({"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0",
                    "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "2",
                    "SLURM_JOB_NODELIST": "a,b,c", "SLURM_JOB_ID": "1"})
    assert (rdv.local_rank, rdv.local_world_size, rdv.store_host) == (0, 1, "a")


def test_slurm_step_nodelist_wins_over_the_job_nodelist():
    rdv = from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-9]",
                    "SLURM_STEP_NODELIST": "n[4-5]", "SLURM_TASKS_PER_NODE": "1(x2)"})
    assert rdv.store_host == "n4"


def test_a_one_node_slurm_step_meets_on_the_loopback_address():
    rdv = from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-9]",
                    "SLURM_STEP_NODELIST": "n4", "SLURM_TASKS_PER_NODE": "2"})
    assert rdv.store_host == "127.0.0.1"


def test_master_addr_wins_over_the_slurm_nodelist():
    rdv = from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                    "MASTER_ADDR": "login", "MASTER_PORT": "6000"})
    assert (rdv.store_host, rdv.store_port) == ("login", 6001)


def test_open_mpi_environment():
    rdv = from_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                    "OMPI_MCA_ess_base_jobid": "123456"})
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size) == (3, 4, 3, 4)
    assert rdv.store_host == "127.0.0.1" and rdv.source == "openmpi"
    assert 20000 <= rdv.store_port < 32000


def test_open_mpi_wins_over_a_batch_steps_slurm_variables():
    rdv = from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                    "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert (rdv.rank, rdv.world_size, rdv.source, rdv.store_host) == (1, 2, "openmpi", "n1")


def test_mpich_environment():
    rdv = from_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                    "MPI_LOCALNRANKS": "2"})
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size) == (1, 2, 1, 2)
    assert rdv.source == "mpich" and rdv.store_host == "127.0.0.1"


def test_mpich_under_srun_takes_local_numbers_from_slurm():
    rdv = from_env({"PMI_RANK": "3", "PMI_SIZE": "4", "SLURM_LOCALID": "1",
                    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1",
                    "SLURM_JOB_NODELIST": "c[1-2]", "SLURM_JOB_ID": "9"})
    assert (rdv.local_rank, rdv.local_world_size, rdv.store_host) == (1, 2, "c1")


def test_world_of_one_uses_a_free_port():
    assert from_env({"RANK": "0", "WORLD_SIZE": "1"}).store_port == 0


# ----------------------------------------------------------------------------- errors
def test_no_launcher_lists_every_variable_looked_for():
    with pytest.raises(RendezvousError) as info:
        from_env({})
    for var in ("GPUCOLL_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                "SLURM_NTASKS"):
        assert var in str(info.value)


@pytest.mark.parametrize("env, job", [
    ({"GPUCOLL_JOB_ID": "run7", "SLURM_JOB_ID": "9"}, "run7"),
    ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}, "torchrun:abc.2"),
    ({"TORCHELASTIC_RUN_ID": "abc"}, "torchrun:abc.0"),
    ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}, "slurm:4242.3"),
    ({"PMIX_NAMESPACE": "prterun-host-1@1"}, "PMIX_NAMESPACE:prterun-host-1@1"),
    ({"OMPI_MCA_ess_base_jobid": "17"}, "OMPI_MCA_ess_base_jobid:17"),
    ({"PATH": "/bin"}, None),
])
def test_job_id_comes_from_the_first_launcher_that_names_one(env, job):
    assert job_id(env) == job


def test_rendezvous_carries_the_job_id():
    rdv = from_env({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "2", "GPUCOLL_JOB_ID": "j1"})
    assert rdv.job_id == "j1"


def test_a_job_id_without_a_port_variable_picks_the_port():
    env = {"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "2"}
    ports = {from_env({**env, "GPUCOLL_JOB_ID": j}).store_port for j in ("a", "b", "c")}
    assert len(ports) == 3 and all(20000 <= p < 32000 for p in ports)


def test_rendezvous_error_is_a_value_error():
    with pytest.raises(ValueError):
        from_env({"PATH": "/bin"})


def test_rendezvous_error_is_exported_in_the_one_hierarchy():
    import gpucoll

    with pytest.raises(gpucoll.GpucollError) as info:
        from_env({"PATH": "/bin"})
    assert type(info.value) is gpucoll.RendezvousError is RendezvousError


def test_missing_world_size_is_named():
    with pytest.raises(RendezvousError, match="WORLD_SIZE is not set"):
        from_env({"RANK": "0"})


def test_non_integer_rank_is_named_with_its_value():
    with pytest.raises(RendezvousError, match="GPUCOLL_RANK='one'"):
        from_env({"GPUCOLL_RANK": "one", "GPUCOLL_WORLD_SIZE": "2"})


def test_rank_outside_the_world_is_refused():
    with pytest.raises(RendezvousError, match="rank 4 is not in a world of 4"):
        from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_several_hosts_without_an_address_say_what_to_set():
    with pytest.raises(RendezvousError, match="GPUCOLL_MASTER_ADDR.*MASTER_ADDR"):
        from_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})


def test_malformed_gpucoll_store_is_named():
    with pytest.raises(RendezvousError, match="GPUCOLL_STORE"):
        from_env({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "1", "GPUCOLL_STORE": "node0"})


@pytest.mark.parametrize("address", ["http://node0:4000", "https://node0:4000", "tcp://a/b:4000",
                                     "tcp://node0:http", "tcp://node 0:4000", "tcp://:4000"])
def test_a_store_address_that_is_not_tcp_host_port_is_refused_naming_it(address):
    with pytest.raises(RendezvousError, match=f"GPUCOLL_STORE: .*{re.escape(address)}"):
        from_env({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "1", "GPUCOLL_STORE": address})


@pytest.mark.parametrize("address", ["tcp://node0:4000", "node0:4000", "tcp://[::1]:4000",
                                     "tcp://10.0.0.1:4000", "tcp://node-0.cluster_a:4000"])
def test_store_addresses_of_every_documented_form_are_read(address):
    rdv = from_env({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "1", "GPUCOLL_STORE": address})
    assert rdv.store_port == 4000 and rdv.store_is_running


def test_a_world_size_beyond_what_one_store_can_gather_is_refused_at_once():
    with pytest.raises(RendezvousError, match="GPUCOLL_WORLD_SIZE=1000000000 is more ranks"):
        from_env({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "1000000000"})
    assert from_env({"RANK": "0", "WORLD_SIZE": str(MAX_WORLD_SIZE)}).world_size == MAX_WORLD_SIZE


def test_rendezvous_is_frozen():
    rdv = from_env({"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        rdv.rank = 1


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("GPUCOLL_RANK", "0")
    monkeypatch.setenv("GPUCOLL_WORLD_SIZE", "1")
    assert from_env().source == "gpucoll"


# ----------------------------------------------------------------------------- hostlists
@pytest.mark.parametrize("spec, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("a,b[1,3],c", ["a", "b1", "b3", "c"]),
    ("x[5]", ["x5"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[01-04", "gpu]1[", "n[4-2]", "n[a-b]", ""])
def test_malformed_hostlist_is_a_value_error(spec):
    with pytest.raises(ValueError):
        expand_hostlist(spec)


# ----------------------------------------------------------------------------- connecting
def _rdv(rank: int, port: int, running: bool) -> Rendezvous:
    return Rendezvous(rank, 2, rank, 2, "127.0.0.1", port, running, None, "gpucoll")


def test_rank_0_hosts_the_store_and_rank_1_connects():
    host = connect_store(_rdv(0, 0, False), timeout=20)
    try:
        assert host.is_server
        other = connect_store(_rdv(1, host.port, False), timeout=20)
        other.set("hello", b"from 1")
        assert host.get("hello") == b"from 1"
        other.close()
    finally:
        host.close()


def test_rank_1_started_first_waits_for_rank_0():
    reserved = socket.socket()
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.bind(("127.0.0.1", 0))
    port = reserved.getsockname()[1]
    got = []

    def rank1():
        with connect_store(_rdv(1, port, False), timeout=30) as store:
            got.append(store.get("from-0", timeout=30))

    t = threading.Thread(target=rank1)
    t.start()
    try:
        with connect_store(_rdv(0, port, False), timeout=30) as store:
            reserved.close()
            store.set("from-0", b"x")
            t.join(40)
    finally:
        reserved.close()
    assert got == [b"x"]


@pytest.mark.filterwarnings("ignore:gpucoll store on .* has no token")
def test_rank_0_on_a_named_host_listens_everywhere_and_reports_that_name():
    rdv = Rendezvous(0, 2, 0, 1, "localhost.", 0, False, None, "gpucoll")
    with connect_store(rdv, timeout=20) as store:
        assert store.is_server and store.host == "localhost."
        with connect_store(dataclasses.replace(rdv, rank=1, store_host="127.0.0.1",
                                               store_port=store.port), timeout=20) as other:
            other.set("k", b"v")
            assert store.get("k") == b"v"


def test_running_store_is_joined_not_hosted(store_server):
    store = connect_store(_rdv(0, store_server.port, True), timeout=20)
    try:
        assert not store.is_server
        store.set("k", b"v")
        assert store_server.get("k") == b"v"
    finally:
        store.close()


def _meet(rank: int, n: int, launcher_env: dict) -> list[bytes]:
    """One rank: read its launcher's variables, get the store, gather every rank's key."""
    env = {k: v.replace("{rank}", str(rank)) for k, v in launcher_env.items()}
    rdv = from_env(env)
    assert (rdv.rank, rdv.world_size) == (rank, n)
    with connect_store(rdv, timeout=60) as store:
        store.set(f"rank/{rank}", str(rank).encode())
        values = store.multi_get([f"rank/{r}" for r in range(n)], timeout=60)
        store.set(f"bye/{rank}", b"1")
        if rank == 0:  # the host keeps serving until everyone has what they need
            store.wait([f"bye/{r}" for r in range(n)], timeout=60)
    return values


def _reserved() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "openmpi", "mpich"])
def test_ranks_meet_through_their_launchers_environment(launcher):
    reserved = _reserved()
    port = reserved.getsockname()[1]
    envs = {
        "torchrun": {"RANK": "{rank}", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port - 1)},
        "slurm": {"SLURM_PROCID": "{rank}", "SLURM_NTASKS": "3", "SLURM_LOCALID": "{rank}",
                  "SLURM_TASKS_PER_NODE": "3", "SLURM_JOB_NODELIST": "127.0.0.1",
                  "GPUCOLL_MASTER_PORT": str(port)},
        "openmpi": {"OMPI_COMM_WORLD_RANK": "{rank}", "OMPI_COMM_WORLD_SIZE": "3",
                    "GPUCOLL_MASTER_PORT": str(port)},
        "mpich": {"PMI_RANK": "{rank}", "PMI_SIZE": "3", "GPUCOLL_MASTER_PORT": str(port)},
    }
    try:
        results = spawn(_meet, 3, envs[launcher], timeout=90)
    finally:
        reserved.close()
    assert results == [[b"0", b"1", b"2"]] * 3


# ----------------------------------------------------------------------------- a group's slot
@pytest.fixture
def fresh_slots(monkeypatch):
    """This process's slot counters as in a process that has made no communicator yet."""
    from gpucoll import rendezvous

    monkeypatch.setattr(rendezvous, "_next_slot", {})


def test_a_one_rank_group_forms_in_the_first_slot_of_its_job(store_server, fresh_slots):
    from gpucoll.rendezvous import join_group

    space = join_group(store_server, 0, 1, job="j", timeout=10)
    assert space.prefix == "gpucoll/jobs/j/0"
    assert store_server.peek(["gpucoll/jobs/j/0/member/0", "gpucoll/jobs/j/0/size"])[1] == b"1"
    assert join_group(store_server, 0, 1, job="j", timeout=10).prefix == "gpucoll/jobs/j/1"


def test_a_crashed_groups_slot_is_skipped_then_cleared(store_server, fresh_slots):
    from gpucoll.rendezvous import join_group

    dead = {"size": b"2", "member/0": b"a", "gone/0": b"died", "member/1": b"b",
            "gone/1": b"closed", "ring/addr/0": b"x"}
    store_server.multi_set([f"gpucoll/jobs/anonymous/0/{k}" for k in dead], list(dead.values()))
    assert join_group(store_server, 0, 1, job=None, timeout=10).prefix == \
        "gpucoll/jobs/anonymous/1"
    assert store_server.peek([f"gpucoll/jobs/anonymous/0/{k}" for k in dead]) == [None] * 6


def test_a_slot_claimed_before_this_process_started_is_a_crashed_jobs_and_skipped(
        store_server, fresh_slots):
    from gpucoll.rendezvous import join_group

    old = f"a@{time.time() - 3600:.3f}".encode()  # claimed an hour ago, then died
    store_server.multi_set(["gpucoll/jobs/anonymous/0/size", "gpucoll/jobs/anonymous/0/member/1",
                            "gpucoll/jobs/anonymous/0/gone/1"], [b"2", old, b"died"])
    assert join_group(store_server, 0, 1, job=None, timeout=10).prefix == \
        "gpucoll/jobs/anonymous/1"


def test_a_rank_of_this_run_that_died_before_this_rank_arrived_is_named_at_once(
        store_server, fresh_slots):
    from gpucoll.rendezvous import join_group

    now = f"a@{time.time():.3f}".encode()  # claimed while this process runs, then died
    store_server.multi_set(["gpucoll/jobs/anonymous/0/size", "gpucoll/jobs/anonymous/0/member/1",
                            "gpucoll/jobs/anonymous/0/gone/1"], [b"2", now, b"died"])
    start = time.monotonic()
    with pytest.raises(PeerFailure, match="rank 1 died during start-up on rank 0 of 2") as got:
        join_group(store_server, 0, 2, job=None, timeout=30)
    assert got.value.peer == 1 and time.monotonic() - start < 5


def test_a_live_process_holding_this_rank_is_an_error_naming_the_job_id(store_server,
                                                                         fresh_slots):
    from gpucoll.rendezvous import join_group

    store_server.multi_set(["gpucoll/jobs/anonymous/0/size", "gpucoll/jobs/anonymous/0/member/1"],
                           [b"2", b"someone"])
    with pytest.raises(RendezvousError, match="another live process already joined "
                                              "gpucoll/jobs/anonymous/0 as rank 1.*GPUCOLL_JOB_ID"):
        join_group(store_server, 1, 2, job=None, timeout=10)


def test_a_group_of_another_size_still_forming_is_an_error_naming_both(store_server,
                                                                      fresh_slots):
    from gpucoll.rendezvous import join_group

    store_server.multi_set(["gpucoll/jobs/anonymous/0/size", "gpucoll/jobs/anonymous/0/member/0"],
                           [b"4", b"alive"])
    with pytest.raises(RendezvousError, match="rank 1 was given world size 2, but the group "
                                              "forming in gpucoll/jobs/anonymous/0 has world "
                                              "size 4"):
        join_group(store_server, 1, 2, job=None, timeout=10)


def test_a_rank_that_never_joins_is_a_timeout_and_its_slot_is_left_marked(store_server,
                                                                         fresh_slots):
    from gpucoll.errors import CollectiveTimeout
    from gpucoll.rendezvous import join_group

    with pytest.raises(CollectiveTimeout, match=r"start-up of job 'j' on rank 0 of 2: "
                                                r"rank 1 never arrived"):
        join_group(store_server, 0, 2, job="j", timeout=0.5)
    assert store_server.get("gpucoll/jobs/j/0/gone/0") == b"closed"


def test_a_timeout_after_skipped_slots_says_a_rank_that_died_early_looks_the_same(
        store_server, fresh_slots):
    from gpucoll.errors import CollectiveTimeout
    from gpucoll.rendezvous import join_group

    store_server.multi_set(["gpucoll/jobs/anonymous/0/gone/1"], [b"died"])
    with pytest.raises(CollectiveTimeout, match=r"never arrived .* joined "
                                                r"gpucoll/jobs/anonymous/1 after skipping 1 "
                                                r"slot\(s\) .* died before the others arrived"):
        join_group(store_server, 0, 2, job=None, timeout=0.5)
