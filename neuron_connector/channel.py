"""The only module that owns ZMQ sockets and pollers.

A channel belongs to exactly one thread (ZMQ sockets are not thread-safe); other threads
reach that thread through a `Waker` (a pipe the poller also watches) plus shared state.
Sends never block: a reply to a peer that is gone or whose queue is full is dropped, so a
slow or dead peer cannot stall the serving loop; the ROUTER says which of the two it was.

Sessions: a DEALER chooses no routing id; the ROUTER assigns one per connection, so a
reconnect is a new session and no peer can claim another's. Heartbeats drop a connection
whose peer vanished (its host gone) within seconds.
"""
from __future__ import annotations

import enum
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Union

import zmq
from zmq.utils.monitor import recv_monitor_message

from neuron_connector.errors import PeerUnavailable

log = logging.getLogger(__name__)

# Bounds what is in flight per peer; a peer over the bound gets its message dropped.
HIGH_WATER_MARK = 1024
_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 1000
# A connect attempt gives up after this and the next one starts afresh. Without it one attempt
# lasts as long as the kernel retries its SYN, ever further apart (1, 2, 4 ... 64 s): after a cut
# cable comes back, the signal plane would wait for the next retry, up to a minute later.
_CONNECT_TIMEOUT_MS = 1000
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


class Delivery(enum.Enum):
    """What became of a ROUTER send."""

    SENT = "sent"
    QUEUE_FULL = "queue_full"     # the peer is connected but slow: it is alive
    PEER_GONE = "peer_gone"       # no connection has this routing id (any more)


class Waker:
    """Lets any thread interrupt a poll: one byte into a pipe the poller watches."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        # Other threads may wake it at any time, even after close: never write to a reused fd number.
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read_fd

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except (BlockingIOError, OSError):
                pass  # pipe full: a wake-up is already pending

    def drain(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class ServiceThread:
    """The one thread that owns a buffer's channels: started once, stopped once, and
    woken from any thread through its `waker`."""

    def __init__(self) -> None:
        self.waker = Waker()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def wake(self) -> None:
        self.waker.wake()

    def stop(self, timeout: float = 10.0) -> bool:
        """Asks the thread to finish and joins it; False when it was stopped before."""
        if self._stop.is_set():
            return False
        self._stop.set()
        self.waker.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        return True

    def close(self) -> None:
        """Frees the waker; after `stop`, once nothing polls it."""
        self.waker.close()

    @staticmethod
    def call(callback: Callable[..., None], *args: object) -> None:
        """Calls an engine's `callback` from the thread: one that raises is logged and never stops the thread."""
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - an engine callback must not kill the signal plane
            log.exception("%s(%s) raised", getattr(callback, "__name__", "a callback"), ", ".join(map(repr, args)))


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)


class RouterChannel:
    """P's ROUTER: bound at `host:port` (0 picks a free port), addressed by the routing id it
    assigned to each connection."""

    def __init__(self, context: zmq.Context, host: str, port: int) -> None:
        self.socket = context.socket(zmq.ROUTER)
        _configure(self.socket)
        # Without MANDATORY a ROUTER silently drops replies to unknown or full peers. No
        # ROUTER_HANDOVER: a connection announcing a routing id already in use is refused.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if port == 0:
                self.port = self.socket.bind_to_random_port(f"tcp://{host}")
            else:
                self.socket.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            hint = " (another process listens there; pick another KV port)" if exc.errno == zmq.EADDRINUSE else ""
            raise PeerUnavailable(f"cannot bind the KV signal plane on {host}:{port}: "
                                  f"{zmq.strerror(exc.errno)}{hint}") from exc

    def recv(self) -> tuple[bytes, bytes] | None:
        """One (identity, payload) if a message is waiting; malformed frames are skipped."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(frames) != 2:
            return b"", b""
        return frames[0], frames[1]

    def send(self, identity: bytes, payload: bytes) -> Delivery:
        try:
            self.socket.send_multipart([identity, payload], zmq.NOBLOCK)
            return Delivery.SENT
        except zmq.Again:
            return Delivery.QUEUE_FULL
        except zmq.ZMQError:
            return Delivery.PEER_GONE   # EHOSTUNREACH: no connection has that routing id

    def close(self, flush_s: float = 0.0) -> None:
        """Closes the socket; replies already queued still go out for up to `flush_s` seconds (the context's
        `term()` waits for them), so a peer is never told "gone" in place of its last answer."""
        self.socket.close(linger=int(flush_s * 1000))


@dataclass(frozen=True, slots=True)
class ConnectionState:
    """What a DealerChannel's monitor said: `lost`, a connection it had was lost since the last read;
    `failing_since`, when connect attempts began to fail with none succeeding since (None: not failing)."""

    lost: bool
    failing_since: float | None


class DealerChannel:
    """D's DEALER to one prefill peer; the peer's ROUTER assigns its routing id. Its monitor says when a
    connection it had is lost (the peer's process ended: at once; its host gone: at the heartbeat timeout),
    and since when every connect attempt has failed (nothing listens there, or its host does not answer)."""

    def __init__(self, context: zmq.Context, host: str, port: int) -> None:
        self.address = f"{host}:{port}"
        self.socket = context.socket(zmq.DEALER)
        _configure(self.socket)
        self.socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        self.socket.setsockopt(zmq.CONNECT_TIMEOUT, _CONNECT_TIMEOUT_MS)
        try:
            self.socket.connect(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            raise PeerUnavailable(f"cannot connect to the KV signal plane at {host}:{port}: {exc}") from exc
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._failing_since: float | None = None

    def recv(self) -> bytes | None:
        try:
            return self.socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def connection_state(self, now: float) -> ConnectionState:
        """The monitor's events since the last call, drained: a connect attempt that failed at `now`
        starts the failing time, a connection ends it."""
        lost = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return ConnectionState(lost, self._failing_since)
            if event == zmq.EVENT_DISCONNECTED:
                lost = True
            elif event == zmq.EVENT_CONNECTED:
                self._failing_since = None
            elif self._failing_since is None:
                self._failing_since = now

    def send(self, payload: bytes) -> bool:
        try:
            self.socket.send(payload, zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False  # queue full while the peer is away: retried on the next resend

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


Pollable = Union[Waker, RouterChannel, DealerChannel]


class Poller:
    """Waits on channels and wakers; `poll` returns the ones that are readable."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._by_key: dict[object, Pollable] = {}

    def register(self, item: Pollable) -> None:
        key: object = item.fileno() if isinstance(item, Waker) else item.socket
        keys = [key, item.monitor] if isinstance(item, DealerChannel) else [key]
        for key in keys:   # a DEALER's monitor events wake the poll as its messages do
            self._poller.register(key, zmq.POLLIN)
            self._by_key[key] = item

    def poll(self, timeout_s: float) -> list[Pollable]:
        events = self._poller.poll(max(0, int(timeout_s * 1000)))
        return [self._by_key[key] for key, _ in events if key in self._by_key]


def new_context() -> zmq.Context:
    """A private context per buffer, so closing one never affects another."""
    return zmq.Context()
