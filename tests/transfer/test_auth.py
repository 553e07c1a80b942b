"""The KV secret on the transports: the tcp listener writes only for writers that prove it."""
from __future__ import annotations

import logging
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.transfer.conftest import LAYOUT
from tests.transfer.peer_proc import block_bytes
from transfer import BackendUnavailable, TransferEngine, Unauthorized, create_transfer_engine, wire
from transfer.blocks import byte_ranges

SECRET = b"the deployment's secret"


def pool_of(engine: TransferEngine) -> Any:
    return engine._region.tensor  # type: ignore[union-attr]


def test_a_writer_with_the_secret_writes(make_engine) -> None:
    writer, listener = make_engine("tcp", secret=SECRET, seed=3), make_engine("tcp", secret=SECRET)
    peer = writer.connect(listener.descriptor())
    writer.queue_transfer_with_token(peer, [1, 2], [5, 6]).wait(10)
    assert block_bytes(pool_of(listener), [5, 6]) == block_bytes(pool_of(writer), [1, 2])


@pytest.mark.parametrize("writer_secret, why", [(None, "no proof"), (b"another secret", "a wrong proof")])
def test_a_writer_without_the_secret_is_refused_and_logged(make_engine, caplog: pytest.LogCaptureFixture,
                                                           writer_secret: bytes | None, why: str) -> None:
    writer, listener = make_engine("tcp", secret=writer_secret, seed=3), make_engine("tcp", secret=SECRET, seed=4)
    before = block_bytes(pool_of(listener), list(range(LAYOUT.num_blocks)))
    with caplog.at_level(logging.WARNING, logger="transfer.tcp"):
        with pytest.raises(Unauthorized, match=f"refused a hello with {why} of the KV secret from 127.0.0.1:"):
            writer.queue_transfer_with_token(writer.connect(listener.descriptor()), [1], [5]).wait(10)
    assert f"tcp KV listener refused a hello with {why} of the KV secret" in caplog.text
    assert block_bytes(pool_of(listener), list(range(LAYOUT.num_blocks))) == before


def test_a_raw_socket_without_the_proof_cannot_write_a_byte(make_engine) -> None:
    listener = make_engine("tcp", secret=SECRET, seed=4)
    before = block_bytes(pool_of(listener), list(range(LAYOUT.num_blocks)))
    info = listener.descriptor()["transports"]["tcp"]
    payload = byte_ranges(LAYOUT, [0], [2]).nbytes
    with socket.create_connection((info["host"], info["port"]), timeout=10) as raw:
        assert raw.recv(wire.CHALLENGE_BYTES, socket.MSG_WAITALL)[:4] == wire.MAGIC
        # A write straight away, no hello: refused before its payload is read.
        raw.sendall(wire.encode_request(wire.Request(wire.OP_WRITE, 1, [(0, 2)], payload)))
        try:
            raw.sendall(b"\xab" * payload)
        except OSError:
            pass  # the listener may have closed already
        head, msg_len = wire.decode_reply_head(raw.recv(wire.REPLY_BYTES, socket.MSG_WAITALL))
        message = raw.recv(msg_len, socket.MSG_WAITALL).decode()
        with pytest.raises(Unauthorized, match="refused a write before an authenticated hello"):
            wire.Reply(head.op, head.transfer_id, head.status, message).raise_for_status()
        try:
            assert raw.recv(1) == b""          # and hung up
        except ConnectionResetError:
            pass
    assert block_bytes(pool_of(listener), list(range(LAYOUT.num_blocks))) == before


def test_nixl_is_refused_with_a_secret_and_auto_never_picks_it(make_engine) -> None:
    with pytest.raises(BackendUnavailable, match="nixl transport cannot authenticate its peers"):
        create_transfer_engine("nixl", secret=SECRET)
    assert "nixl" not in make_engine("auto", secret=SECRET).backend


def test_shm_pools_are_private_to_this_user(make_engine) -> None:
    segment = Path("/dev/shm") / make_engine("shm", secret=SECRET).descriptor()["transports"]["shm"]["segment"]
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
