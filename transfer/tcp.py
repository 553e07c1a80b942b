"""Cross-host transport over one persistent TCP connection per peer.

The side whose pool is written (decode) runs a listener; each accepted connection gets a
thread that serves requests one after another. A write request is a header with the
destination block ranges followed by the source chunk ranges sent with scatter-gather
`sendmsg`; the server receives them with `recvmsg` straight into its pool and acks, so the
sender's token completes only after the bytes landed. One transfer at a time per
connection, each framed by its header, so any number of queued transfers share the
connection safely.

The listener writes into its pool, so with a KV secret it authenticates every writer:
it opens each connection with a random challenge, and only a hello proving the secret
over that challenge (`wire.HELLO_PROOF`) lets writes through; anything else gets an
Unauthorized reply, is logged, and the connection is closed before a byte reaches the pool.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import socket
import threading
from typing import Any, Sequence

from common.kv_secret import proof, verify
from transfer.backend import Backend, Link, remaining
from transfer.blocks import Ranges, Run, byte_ranges, local_ranges
from transfer.errors import (InvalidBlocks, LayoutMismatch, PeerLost, RegionNotRegistered, StaleHandoff,
                             TransferError, Unauthorized)
from transfer.fences import run_blocks
from transfer.layout import KVLayout
from transfer.memcopy import crc32c_ranges
from transfer.region import Region
from transfer.sockio import (blocking, deadline_in, drain, recv_bytes, recv_ranges, send_bytes, send_ranges,
                             translated, tune)
from transfer import wire

log = logging.getLogger(__name__)

# The bytes of a checked push summed at a time, then sent: about what the CPU's L2 cache holds.
_SUMMED_PART_BYTES = 1 << 20


def _read_reply(sock: socket.socket, deadline: float) -> wire.Reply:
    head, msg_len = wire.decode_reply_head(recv_bytes(sock, wire.REPLY_BYTES, deadline))
    message = recv_bytes(sock, msg_len, deadline).decode(errors="replace")
    return wire.Reply(head.op, head.transfer_id, head.status, message)


class TcpLink(Link):
    """One persistent connection to a peer's listener, one framed transfer at a time.

    The hello names the listener's engine (`transfer_id`: a restarted peer on the same port
    is not it) and, with a `secret`, proves it over the listener's challenge."""

    def __init__(self, address: tuple[str, int], transfer_id: str, secret: bytes | None,
                 deadline: float) -> None:
        self._ids = itertools.count(1)
        with translated(f"connect to {address[0]}:{address[1]}"):
            self._sock = blocking(tune(socket.create_connection(address, timeout=remaining(deadline))))
        try:
            challenge = wire.decode_challenge(recv_bytes(self._sock, wire.CHALLENGE_BYTES, deadline))
            hello: dict[str, Any] = {"transfer_id": transfer_id}
            if secret is not None:
                hello["proof"] = proof(secret, wire.HELLO_PROOF, challenge.hex(), transfer_id)
            send_bytes(self._sock, wire.encode_hello(hello), deadline)
            _read_reply(self._sock, deadline).raise_for_status()
        except BaseException:
            self._sock.close()
            raise

    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        self._write(region, runs, deadline, False, generation)

    def write_summed(self, region: Region, runs: Sequence[Run], deadline: float,
                     generation: int | None = None) -> int:
        crc = self._write(region, runs, deadline, True, generation)
        assert crc is not None
        return crc

    def _write(self, region: Region, runs: Sequence[Run], deadline: float, summed: bool,
               generation: int | None) -> int | None:
        ranges = local_ranges(region.layout, runs)
        tid = self._request(runs, ranges.nbytes, deadline, generation)
        if not summed:
            send_ranges(self._sock, region.address, ranges, deadline)
            crc = None
        else:
            # Each part is summed just before it is sent, so the kernel copies it out of the cache:
            # the blocks are read from memory once.
            crc = 0
            for part in ranges.batches(_SUMMED_PART_BYTES):
                crc = crc32c_ranges(region.address, part.offsets, part.lengths, crc)
                send_ranges(self._sock, region.address, part, deadline)
        self._reply(tid, deadline)
        return crc

    def _request(self, runs: Sequence[Run], size: int, deadline: float, generation: int | None) -> int:
        tid = next(self._ids)
        op = wire.OP_WRITE if generation is None else wire.OP_FENCED_WRITE
        head = wire.encode_request(wire.Request(op, tid, [(r.remote, r.count) for r in runs], size, generation))
        send_bytes(self._sock, head, deadline)
        return tid

    def _reply(self, tid: int, deadline: float) -> None:
        reply = _read_reply(self._sock, deadline)
        if reply.transfer_id != tid:
            raise PeerLost(f"reply for transfer {reply.transfer_id}, expected {tid}")
        reply.raise_for_status()

    def close(self) -> None:
        self._sock.close()


class TcpBackend(Backend):
    """Listens on `host:port` (0: any free port) and reaches peers that offer tcp; with a
    `secret`, writes only for writers that prove it, and proves it to the peers it writes to."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 frame_timeout: float = 60.0, transfer_id: str = "", secret: bytes | None = None) -> None:
        self._region: Region | None = None
        self._transfer_id = transfer_id
        self._secret = secret
        self._frame_timeout = frame_timeout
        self._listener = tune(socket.create_server((host, port), backlog=64))
        self._address = (advertise_host or (socket.gethostname() if host in ("", "0.0.0.0") else host),
                         self._listener.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.stale_writes = 0    # fenced writes refused: their handoff's blocks were not open for them
        threading.Thread(target=self._accept, name="tcp-listener", daemon=True).start()

    def bind(self, region: Region) -> None:
        self._region = region

    def unbind(self) -> None:
        self._region = None

    def describe(self) -> dict[str, Any] | None:
        return {"host": self._address[0], "port": self._address[1]}

    def reaches(self, descriptor: dict[str, Any]) -> bool:
        return "tcp" in descriptor.get("transports", {})

    def connect(self, descriptor: dict[str, Any], peer_layout: KVLayout, deadline: float) -> Link:
        info = descriptor["transports"]["tcp"]
        return TcpLink((info["host"], int(info["port"])), str(descriptor.get("transfer_id", "")), self._secret,
                       deadline)

    def close(self) -> None:
        self.unbind()
        try:
            # close() alone leaves a thread blocked in accept() and the port listening.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    # -- server side --------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tcp-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            challenge = secrets.token_bytes(32)
            send_bytes(conn, wire.encode_challenge(challenge), deadline_in(self._frame_timeout))
            trusted = self._secret is None
            while True:
                # Idle connections wait without limit; once a frame starts it must finish.
                head = recv_bytes(conn, wire.REQUEST_BYTES, None)
                op, tid, count, payload = wire.decode_request_head(head)
                deadline = deadline_in(self._frame_timeout)
                if op == wire.OP_HELLO:
                    self._serve_hello(conn, recv_bytes(conn, payload, deadline), challenge, deadline)
                    trusted = True
                    continue
                if not trusted:
                    self._refuse(conn, wire.OP_WRITE, tid, "a write before an authenticated hello", deadline)
                ranges = wire.decode_ranges(recv_bytes(conn, 16 * count, deadline))
                generation = None if op != wire.OP_FENCED_WRITE else wire.decode_generation(
                    recv_bytes(conn, wire.GENERATION_BYTES, deadline))
                self._serve_write(conn, tid, ranges, payload, deadline, generation)
        except TransferError as exc:
            log.debug("tcp connection ended: %s", exc)
        except Exception:  # noqa: BLE001 - a bad peer must not take the listener down
            log.exception("tcp connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_hello(self, conn: socket.socket, body: bytes, challenge: bytes, deadline: float) -> None:
        hello = wire.decode_hello(body)
        if self._secret is not None and not verify(self._secret, wire.HELLO_PROOF, hello.get("proof"),
                                                   challenge.hex(), self._transfer_id):
            why = "no proof of the KV secret" if "proof" not in hello else "a wrong proof of the KV secret"
            self._refuse(conn, wire.OP_HELLO, 0, f"a hello with {why}", deadline)
        error: TransferError | None = None
        if hello.get("transfer_id") != self._transfer_id:
            error = PeerLost(f"this listener serves engine {self._transfer_id}, not {hello.get('transfer_id')}")
        send_bytes(conn, wire.encode_reply(wire.OP_HELLO, 0, error), deadline)
        if error is not None:
            raise error

    def _refuse(self, conn: socket.socket, op: int, tid: int, what: str, deadline: float) -> None:
        """Answers Unauthorized and raises it, which closes the connection unread."""
        peer = _peer_name(conn)
        log.warning("tcp KV listener refused %s from %s: the writer must prove the KV secret", what, peer)
        error = Unauthorized(f"KV transfer listener {self._transfer_id} refused {what} from {peer}")
        send_bytes(conn, wire.encode_reply(op, tid, error), deadline)
        raise error

    def _target(self, ranges: list[tuple[int, int]], payload: int) -> tuple[Region, Ranges]:
        """Our region and its byte ranges for the requested blocks, after checking them."""
        region = self._region
        if region is None:
            raise RegionNotRegistered("no region is registered on this peer")
        layout = region.layout
        bad = [(s, c) for s, c in ranges if c <= 0 or s + c > layout.num_blocks]
        if bad:
            raise InvalidBlocks(f"block ranges out of [0, {layout.num_blocks}): {bad[:8]}")
        spans = byte_ranges(layout, [s for s, _ in ranges], [c for _, c in ranges])
        if spans.nbytes != payload:
            raise LayoutMismatch(f"payload of {payload} bytes does not match the blocks' size")
        return region, spans

    def _serve_write(self, conn: socket.socket, tid: int, ranges: list[tuple[int, int]],
                     payload: int, deadline: float, generation: int | None) -> None:
        """Receives into our blocks; a fenced write only while they are open for its generation
        (transfer.fences), else its bytes are read and dropped, and it is answered StaleHandoff."""
        blocks = fences = None
        try:
            region, spans = self._target(ranges, payload)
            if generation is not None and region.fences is not None:
                fences, blocks = region.fences, run_blocks(ranges)
                if not fences.acquire(blocks, generation):
                    fences = None
                    self.stale_writes += 1
                    raise StaleHandoff(f"blocks {ranges[:8]} are not held for handoff {generation} "
                                       f"by {self._transfer_id}: its bytes were dropped")
        except TransferError as exc:
            drain(conn, payload, deadline)
            send_bytes(conn, wire.encode_reply(wire.OP_WRITE, tid, exc), deadline)
            return
        # While we hold the blocks for the handoff, its landing mark follows the receive (transfer.landing).
        marks, first = (region.marks, min(s for s, _ in ranges)) if fences is not None else (None, 0)
        try:
            recv_ranges(conn, region.address, spans, deadline,
                        None if marks is None else (lambda landed: marks.publish(first, landed)))
        finally:
            current = fences is None or fences.release(blocks, generation)  # type: ignore[arg-type]
        error = None if current else StaleHandoff(f"handoff {generation} was given up while it was written")
        send_bytes(conn, wire.encode_reply(wire.OP_WRITE, tid, error), deadline)


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a peer that left"
    return f"{host}:{port}"
