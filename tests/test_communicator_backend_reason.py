"""``Communicator.backend_reason``: why the communicator runs on its backend, logged once."""

from __future__ import annotations

import logging

import pytest

from gpucoll.backends.nccl import backend as nccl_backend
from gpucoll.default import create


@pytest.fixture
def no_backend_override(monkeypatch):
    monkeypatch.delenv("GPUCOLL_BACKEND", raising=False)
    monkeypatch.delenv("GPUCOLL_TRANSPORT", raising=False)


def test_a_backend_requested_by_name_says_so(no_backend_override):
    with create("ring", rank=0, world_size=1) as comm:
        assert comm.backend_reason == "backend='ring' was requested"


def test_auto_reports_the_reason_the_ranks_agreed_on(no_backend_override, monkeypatch):
    monkeypatch.setattr(nccl_backend, "local_verdict",
                        lambda **kw: {"ok": False, "why": "no GPU (test)"})
    with create("auto", rank=0, world_size=1) as comm:
        assert comm.backend == "ring"
        assert comm.backend_reason == ("auto: the host ring, because rank 0 cannot use NCCL: "
                                       "no GPU (test)")


def test_the_choice_is_logged_once_at_info_on_the_gpucoll_logger(no_backend_override, caplog):
    with caplog.at_level(logging.INFO, logger="gpucoll"):
        with create("ring", rank=0, world_size=1):
            pass
    chosen = [r for r in caplog.records if "backend='ring' was requested" in r.getMessage()]
    assert len(chosen) == 1
    assert chosen[0].name == "gpucoll" and chosen[0].levelno == logging.INFO
    assert chosen[0].getMessage() == "rank 0 of 1: backend ring (backend='ring' was requested)"


def test_backend_reason_is_read_only(no_backend_override):
    with create("ring", rank=0, world_size=1) as comm:
        with pytest.raises(AttributeError):
            comm.backend_reason = "something else"


def test_a_split_communicator_names_its_parent_s_reason(no_backend_override):
    with create("ring", rank=0, world_size=1) as comm:
        sub = comm.split(0)
        assert sub.backend_reason == ("split from a ring communicator: backend='ring' was "
                                      "requested")
