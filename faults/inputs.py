"""Malformed input for a fault campaign: bad HTTP bodies at the proxy and at every worker, bad ZMQ
frames at every prefill worker's signal port. Each is one Outcome (see fault_clients): a clear
error when the server refused it as the OpenAI API (or the signal-plane protocol) says it should.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid

import httpx
import zmq

from neuron_connector.protocol import Handshake

from faults.clients import ERROR, HUNG, OK, UNCLEAR, Outcome, answer
from faults.stacks import FaultStack

MODEL = "neuron-di-builtin"
_GOOD = {"model": MODEL, "prompt": [65, 66, 67], "max_tokens": 4, "temperature": 0.0}
# (what it is, path, raw body, the statuses that refuse it clearly)
HTTP_CASES: list[tuple[str, str, bytes, set[int]]] = [
    ("bad JSON", "/v1/completions", b'{"model": "x", "prompt": ', {400}),
    ("empty body", "/v1/completions", b"", {400}),
    ("not an object", "/v1/completions", b"[1, 2, 3]", {400}),
    ("max_tokens a string", "/v1/completions", json.dumps({**_GOOD, "max_tokens": "ten"}).encode(), {400}),
    ("temperature a string", "/v1/completions", json.dumps({**_GOOD, "temperature": "hot"}).encode(), {400}),
    ("stream a string", "/v1/completions", json.dumps({**_GOOD, "stream": "yes"}).encode(), {400}),
    ("prompt a number", "/v1/completions", json.dumps({**_GOOD, "prompt": 5}).encode(), {400}),
    ("no prompt", "/v1/completions", json.dumps({"model": MODEL, "max_tokens": 4}).encode(), {400}),
    ("empty prompt", "/v1/completions", json.dumps({**_GOOD, "prompt": []}).encode(), {400}),
    ("negative token id", "/v1/completions", json.dumps({**_GOOD, "prompt": [65, -1]}).encode(), {400}),
    ("token id past the vocabulary", "/v1/completions", json.dumps({**_GOOD, "prompt": [10 ** 9]}).encode(), {400}),
    ("fractional token id", "/v1/completions", json.dumps({**_GOOD, "prompt": [65, 1.5]}).encode(), {400}),
    ("prompt longer than the model", "/v1/completions", json.dumps({**_GOOD, "prompt": [65] * 100_000}).encode(),
     {400}),
    ("deeply nested body", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {400}),
    ("huge body (10 MB)", "/v1/completions", json.dumps({**_GOOD, "prompt": "x" * 10_000_000}).encode(), {400}),
    ("body over the size limit (20 MB)", "/v1/completions",
     json.dumps({**_GOOD, "prompt": "x" * 20_000_000}).encode(), {413}),
    ("messages a string", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), {400}),
]
# Single frames a prefill worker must answer with {"status": "error", "message": ...}.
ZMQ_BAD_FRAMES: list[bytes] = [
    b"", b"not json", b"\xff\xfe\x00\x01", b"[1, 2]", b"{}", b'{"type": "nope"}', b'{"type": "lookup_all"}',
    b'{"type": "lookup_all", "request_id": 5, "block_ids_in_peer_device": "x"}',
    b'{"type": "lookup_all", "request_id": "never-initialised", "block_ids_in_peer_device": [1]}',
    b'{"type": "kv_map_init", "kv_map": "junk"}', os.urandom(1 << 20),
]
REPLY_WITHIN_S = 10.0


async def malformed_http(faults: FaultStack, deadline_s: float) -> list[Outcome]:
    """Every HTTP case at the proxy and at every worker."""
    targets = [faults.url, *faults.stack.worker_urls.values()]
    return [await _refused(f"{target}{path}", what, raw, statuses, deadline_s)
            for target in targets for what, path, raw, statuses in HTTP_CASES]


async def _refused(url: str, what: str, raw: bytes, statuses: set[int], deadline_s: float) -> Outcome:
    try:
        status, reply = await asyncio.wait_for(post_reading_early(url, raw), deadline_s)
    except asyncio.TimeoutError:
        return Outcome(HUNG, f"{what} at {url}: no answer within {deadline_s:g} s")
    except (OSError, ValueError) as exc:
        return Outcome(UNCLEAR, f"{what} at {url}: {type(exc).__name__}: {exc}")
    outcome = answer(status, reply)
    if outcome.verdict == ERROR and status in statuses:
        return outcome
    return Outcome(UNCLEAR, f"{what} at {url}: HTTP {status}, want {sorted(statuses)} with an "
                            f"OpenAI error body: {reply[:200]!r}", status=status)


async def post_reading_early(url: str, raw: bytes) -> tuple[int, bytes]:
    """POSTs `raw` as JSON and reads the answer while still sending, as curl does: a server may
    refuse a body that is too large before it has all arrived, then close the connection."""
    address = httpx.URL(url)
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, (address.host, address.port))
        head = (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (address.raw_path, address.host.encode(), len(raw)))
        sending = asyncio.create_task(_send(loop, sock, head + raw))
        try:
            return await _read_answer(loop, sock)
        finally:
            sending.cancel()


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    try:
        await loop.sock_sendall(sock, data)
    except ConnectionError:
        pass  # the server answered and closed before taking the rest: the answer is still read


async def _read_answer(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the answer; raises ValueError if the connection ends before it did."""
    data = b""
    while True:
        head, found, rest = data.partition(b"\r\n\r\n")
        if found:
            lines = head.decode("latin-1").split("\r\n")
            length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                           if k.strip().lower() == "content-length"), None)
            if length is not None and len(rest) >= length:
                return int(lines[0].split()[1]), rest[:length]
        chunk = await loop.sock_recv(sock, 1 << 16)
        if not chunk:
            if found and length is None:
                return int(lines[0].split()[1]), rest  # Connection: close ends the body
            raise ValueError(f"the connection ended after {len(data)} bytes of the answer")
        data += chunk


async def malformed_zmq(faults: FaultStack, deadline_s: float) -> list[Outcome]:
    """Bad frames at every prefill worker's signal port; then a handshake must still be answered."""
    outcomes = []
    for name in faults.names("prefill worker"):
        health = httpx.get(f"{faults.stack.worker_urls[name]}/health", timeout=10.0).json()
        port = int(health["worker"]["kv_port"])
        outcomes += await asyncio.to_thread(_zmq_cases, port)
    return outcomes


def _zmq_cases(port: int) -> list[Outcome]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        outcomes = [_ask(dealer, frame, want_error=True) for frame in ZMQ_BAD_FRAMES]
        dealer.send_multipart([b"three", b"frames", b"at once"])  # skipped by the ROUTER, no reply
        _raw_garbage(port)
        hello = Handshake(engine_id=f"stranger-{uuid.uuid4().hex[:8]}", nonce=uuid.uuid4().hex)
        outcomes.append(_ask(dealer, hello.to_bytes(), want_error=False))
        return outcomes
    finally:
        dealer.close()
        context.term()


def _ask(dealer: zmq.Socket, frame: bytes, want_error: bool) -> Outcome:
    what = f"ZMQ frame {frame[:60]!r}{'...' if len(frame) > 60 else ''}"
    dealer.send(frame)
    if not dealer.poll(int(REPLY_WITHIN_S * 1000)):
        return Outcome(HUNG, f"{what}: no reply within {REPLY_WITHIN_S:g} s")
    raw = dealer.recv()
    try:
        reply = json.loads(raw)
    except ValueError:
        return Outcome(UNCLEAR, f"{what}: a reply that is not JSON: {raw[:200]!r}")
    if want_error and reply.get("status") == "error" and reply.get("message"):
        return Outcome(ERROR, reply["message"])
    if not want_error and reply.get("status") == "ok":
        return Outcome(OK, "answered after the junk")
    return Outcome(UNCLEAR, f"{what}: reply {raw[:200]!r}")


def _raw_garbage(port: int) -> None:
    """Bytes that are no ZMTP greeting, sent by a plain TCP client that then leaves."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(os.urandom(4096))
