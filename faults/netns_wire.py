"""The cable between two network-namespace hosts: two TAP devices and this process copying
Ethernet frames between them, with a fixed delay, random loss, or a cut (every frame dropped).

    python faults/netns_wire.py TAP_A TAP_B [--seed N]

It creates both TAP devices, prints "ready", and serves until its standard input closes (so
it never outlives the process that started it). Each line on standard input sets the link:
`{"delay_ms": 20, "loss_pct": 1.5, "up": true}` (fields left out keep their value); each is
answered with "ok" or "error: ...". It also ends when a TAP device is deleted. This is
netem's delay and loss done in user space, for kernels built without sch_netem; the hosts see
an ordinary Ethernet link either way.
"""
from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import random
import select
import struct
import sys
import time
from dataclasses import dataclass

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_MAX_FRAME = 65536


@dataclass(slots=True)
class LinkState:
    """What the wire does to every frame."""

    delay_ms: float = 0.0
    loss_pct: float = 0.0
    up: bool = True

    def update(self, command: dict[str, object]) -> None:
        """Applies one command; ValueError (state unchanged) for an unknown field or a bad value."""
        unknown = set(command) - {"delay_ms", "loss_pct", "up"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        delay = float(command.get("delay_ms", self.delay_ms))  # type: ignore[arg-type]
        loss = float(command.get("loss_pct", self.loss_pct))  # type: ignore[arg-type]
        up = command.get("up", self.up)
        if delay < 0 or not 0 <= loss <= 100 or not isinstance(up, bool):
            raise ValueError(f"need delay_ms >= 0, 0 <= loss_pct <= 100, up true|false; got {command}")
        self.delay_ms, self.loss_pct, self.up = delay, loss, up


def open_tap(name: str) -> int:
    """A new TAP device `name` (no packet-info header); the returned fd carries its frames."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Wire:
    """Copies frames between two TAP fds under a LinkState; delayed frames wait in FIFO order."""

    def __init__(self, fd_a: int, fd_b: int, seed: int) -> None:
        self.state = LinkState()
        self._peer = {fd_a: fd_b, fd_b: fd_a}
        self._rng = random.Random(seed)
        self._queue: collections.deque[tuple[float, int, bytes]] = collections.deque()

    def serve(self, control: int) -> None:
        """Runs until `control` (a line-based command fd) reaches end of file or a device is deleted."""
        pending = b""
        while True:
            timeout = max(0.0, self._queue[0][0] - time.monotonic()) if self._queue else None
            ready, _, _ = select.select([control, *self._peer], [], [], timeout)
            if control in ready:
                chunk = os.read(control, 4096)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self._command(line)
            for fd in ready:
                if fd in self._peer and not self._take(fd):
                    return
            self._release()

    def _command(self, line: bytes) -> None:
        try:
            self.state.update(json.loads(line))
            answer = "ok"
        except (ValueError, TypeError, AttributeError) as exc:
            answer = f"error: {exc}"
        print(answer, flush=True)

    def _take(self, fd: int) -> bool:
        """Queues the frames waiting on `fd`; False once its device is gone (its namespace was deleted)."""
        while True:
            try:
                frame = os.read(fd, _MAX_FRAME)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not self.state.up or self._rng.random() * 100 < self.state.loss_pct:
                continue
            self._queue.append((time.monotonic() + self.state.delay_ms / 1000, self._peer[fd], frame))

    def _release(self) -> None:
        now = time.monotonic()
        while self._queue and self._queue[0][0] <= now:
            _, fd, frame = self._queue.popleft()
            try:
                os.write(fd, frame)
            except OSError:
                pass  # the far device is down or full: the frame is lost, as on a cable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tap_a")
    parser.add_argument("tap_b")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss draws (default 0)")
    args = parser.parse_args(argv)
    try:
        fds = open_tap(args.tap_a), open_tap(args.tap_b)
    except OSError as exc:
        print(f"error: cannot create TAP devices: {exc}", flush=True)
        return 1
    print("ready", flush=True)
    Wire(*fds, seed=args.seed).serve(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
