"""gpucoll.distributed, torch.distributed's functional API on the communicator: every call on
real torch CPU tensors against expected values on 2 and 3 ranks, the refusals, the life cycle,
NumPy without torch, and a torch training script that ends bit-identical to torch's own gloo.

One spawn per world size runs every case of ``torch_cases``; the tests below read its report,
one case per test.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import torch_cases  # noqa: E402 - needs torch
from multiproc import spawn  # noqa: E402

from gpucoll.store import TCPStore  # noqa: E402

# torch tensors through the torch-shaped module, and gloo beside it
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(rank: int, n: int, port: int) -> dict:
    import gpucoll.distributed as dist

    store = TCPStore("127.0.0.1", port, timeout=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=60)
    try:
        return torch_cases.run(dist)
    finally:
        dist.destroy_process_group()
        store.close()


@functools.cache
def reports(size: int) -> list[dict]:
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
    try:
        return spawn(_run, size, server.port, timeout=300)
    finally:
        server.close()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", [name for name, _ in torch_cases.CASES])
def test_torch_call(name, size):
    failures = [f"### rank {rank}\n{report[name]}" for rank, report in enumerate(reports(size))
                if report[name]]
    assert not failures, "\n".join(failures)


# -- one process ---------------------------------------------------------------------------------

def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GPUCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_without_torch_the_module_imports_and_takes_numpy_arrays():
    done = _python("""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed: importing it fails
        import numpy as np
        import gpucoll.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1)
        a = np.arange(4.0)
        dist.all_reduce(a, op=dist.ReduceOp.MAX)
        out = [np.zeros(4)]
        dist.all_gather(out, a)
        every = [None]
        dist.all_gather_object(every, {"x": 1})
        dist.destroy_process_group()
        print("ok", out[0].tolist(), every)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok [0.0, 1.0, 2.0, 3.0] [{'x': 1}]"


def test_importing_the_module_does_not_import_torch():
    done = _python("""
        import sys
        import gpucoll.distributed
        print("torch" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_init_and_destroy_follow_the_process_group_life_cycle():
    done = _python("""
        import numpy as np
        import gpucoll.distributed as dist
        assert not dist.is_initialized()
        try:
            dist.all_reduce(np.ones(2))
        except RuntimeError as e:
            print(e)
        dist.init_process_group("gloo", rank=0, world_size=1)
        assert dist.is_initialized()
        try:
            dist.init_process_group("gloo", rank=0, world_size=1)
        except RuntimeError as e:
            print(e)
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        dist.destroy_process_group()
        assert not dist.is_initialized()
        dist.init_process_group(rank=0, world_size=1)  # a second job in the same process
        dist.destroy_process_group()
        print("done")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "all_reduce: the default process group is not initialized; call "
        "dist.init_process_group() first",
        "init_process_group: the default process group is already initialized; call "
        "dist.destroy_process_group() first", "done"]


def test_an_unknown_backend_is_refused_naming_the_ones_there_are():
    done = _python("""
        import gpucoll.distributed as dist
        try:
            dist.init_process_group("mpi", rank=0, world_size=1)
        except ValueError as e:
            print(e)
        print(dist.is_initialized())
    """)
    assert done.returncode == 0, done.stderr
    assert "backend='mpi' is not supported; expected 'gloo'" in done.stdout
    assert done.stdout.splitlines()[-1] == "False"


# -- the same training script on torch.distributed and on gpucoll.distributed ----------------------

def _launch(*args: str) -> subprocess.CompletedProcess:
    """``gpucoll run -n 2 ARGS`` with a 60 s deadline on every call, 300 s in all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOLL_")}
    env["GPUCOLL_TIMEOUT"] = "60"
    return subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "2", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def _train(module: str, out: str) -> None:
    done = _launch(os.path.join(HERE, "helpers", "torch_training.py"), module, out)
    if module == "torch" and done.returncode != 0 and \
            "terminate called without an active exception" in done.stderr:
        # torch's gloo sometimes aborts a rank as it shuts down (a C++ thread never joined);
        # that is the reference run's own failure, not what is under test: run it again
        done = _launch(os.path.join(HERE, "helpers", "torch_training.py"), module, out)
    assert done.returncode == 0, f"{module}:\n{done.stdout}\n{done.stderr}"


def test_training_ends_bit_identical_to_torch_distributed_on_gloo(tmp_path):
    ours, theirs = str(tmp_path / "gpucoll.pt"), str(tmp_path / "torch.pt")
    _train("gpucoll", ours)
    _train("torch", theirs)
    a, b = torch.load(ours), torch.load(theirs)
    assert a.keys() == b.keys() == {"sgd", "adam", "losses"}
    for key in ("sgd", "adam"):
        assert a[key].dtype == b[key].dtype == torch.float32
        assert torch.equal(a[key], b[key]), f"{key}: parameters differ"
    assert a["losses"] == b["losses"]
    # it trained: the loss moved, and the two optimisers went different ways
    assert a["losses"][-1] != a["losses"][0]
    assert not torch.equal(a["sgd"], a["adam"])


# -- hostile: one rank alone passes a wrong argument ---------------------------------------------

def _one_rank_wrong(rank: int, n: int, port: int) -> str:
    import gpucoll.distributed as dist
    from gpucoll.errors import GpucollError

    store = TCPStore("127.0.0.1", port, timeout=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=30)
    try:
        out = torch.zeros(n * 3 + (rank == 1))  # rank 1 alone: one element too many
        dist.all_gather_into_tensor(out, torch.ones(3))
        return "returned"
    except ValueError as e:  # rank 1, before sending anything
        return f"ValueError: {e}"
    except GpucollError as e:  # the others, once rank 1 has left
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
        store.close()


def test_a_wrong_shape_on_one_rank_fails_there_and_the_others_hear_of_it():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
    try:
        got = spawn(_one_rank_wrong, 3, server.port, timeout=120)
    finally:
        server.close()
    assert got[1].startswith("ValueError: all_gather_into_tensor on rank 1 of 3: output_tensor "
                             "has shape [10]"), got[1]
    for rank in (0, 2):
        assert "rank 1" in got[rank] and not got[rank].startswith("returned"), got[rank]
