"""A real etcd whose picked client port was taken before it bound it starts again on new ports; any other
failure is not retried."""
from __future__ import annotations

import pytest

import stack.etcd
from stack.etcd import EtcdServer
from stack.serving import StackError, free_port, port_was_taken


def test_etcd_starts_again_on_new_ports_when_its_port_was_taken(taken_port: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([taken_port])
    monkeypatch.setattr(stack.etcd, "free_port", lambda: next(picks, None) or free_port())
    server = EtcdServer()
    try:
        assert server.port != taken_port
    finally:
        server.stop()


def test_a_port_still_taken_after_every_attempt_fails_naming_it(taken_port: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack.etcd, "free_port", lambda: taken_port)
    with pytest.raises(StackError, match="address already in use") as failed:
        EtcdServer(attempts=2)
    assert port_was_taken(failed.value)


def test_only_a_taken_port_counts() -> None:
    assert port_was_taken(StackError("OSError: [Errno 98] Address already in use"))
    assert not port_was_taken(StackError("the etcd exited with status 1: no such file"))
