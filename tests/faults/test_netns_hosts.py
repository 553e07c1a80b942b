"""The two-host machinery itself: the cable's frame copier (over socket pairs, no root needed) and
TwoHosts (real namespaces): hosts reach each other over the cable and this process over the
management LAN, a cut cable stops only the first, and everything made is gone afterwards, also
when the body raises.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from faults.netns_hosts import Host, NetnsUnavailable, TwoHosts, check_available, ip, reap_stale_namespaces
from faults.netns_wire import LinkState, Wire
from tests.helpers import wait_until


@pytest.mark.parametrize("command", [{"loss_pct": 101}, {"delay_ms": -1}, {"up": "no"}, {"jitter_ms": 3}])
def test_a_bad_cable_command_is_refused_and_changes_nothing(command: dict) -> None:
    state = LinkState(delay_ms=5)
    with pytest.raises(ValueError):
        state.update(command)
    assert state == LinkState(delay_ms=5)
    state.update({"loss_pct": 2})
    assert state == LinkState(delay_ms=5, loss_pct=2)


@pytest.fixture
def wire() -> Iterator[tuple[Wire, socket.socket, socket.socket, socket.socket]]:
    """A Wire between two SEQPACKET socket pairs (frames keep their bounds, as on a TAP device)."""
    host_a, wire_a = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    host_b, wire_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control, control_end = socket.socketpair()
    for sock in (wire_a, wire_b):
        sock.setblocking(False)
    copier = Wire(wire_a.fileno(), wire_b.fileno(), seed=1)
    thread = threading.Thread(target=copier.serve, args=(control_end.fileno(),), daemon=True)
    thread.start()
    yield copier, host_a, host_b, control
    control.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    for sock in (host_a, wire_a, host_b, wire_b, control_end):
        sock.close()


def test_the_wire_copies_frames_both_ways_after_the_delay(wire) -> None:
    _, host_a, host_b, _ = wire
    host_a.settimeout(10)
    host_b.settimeout(10)
    host_a.send(b"frame 1")
    assert host_b.recv(100) == b"frame 1"
    wire[0].state.update({"delay_ms": 200})
    start = time.monotonic()
    host_b.send(b"frame 2")
    assert host_a.recv(100) == b"frame 2"
    assert time.monotonic() - start >= 0.2


def test_a_cut_or_full_loss_drops_every_frame(wire) -> None:
    copier, host_a, host_b, _ = wire
    host_b.settimeout(0.3)
    for state in ({"up": False}, {"up": True, "loss_pct": 100}):
        copier.state.update(state)
        host_a.send(b"lost")
        with pytest.raises(socket.timeout):
            host_b.recv(100)
    copier.state.update({"loss_pct": 0})
    host_a.send(b"through")
    host_b.settimeout(10)
    assert host_b.recv(100) == b"through"


def namespaces_or_skip() -> None:
    try:
        check_available()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network-namespace hosts here: {exc}")


def connects(prefix: list[str], address: str, port: int) -> bool:
    """Whether a TCP connection from a process started under `prefix` reaches address:port within 2 s."""
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, timeout=30).returncode == 0


def listener(host: Host, port: int) -> subprocess.Popen:
    code = (f"import socket; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen()\n"
            "while True: s.accept()[0].close()")
    return subprocess.Popen([*host.prefix, sys.executable, "-c", code])


def ours() -> tuple[set[str], set[str]]:
    """Namespaces and interfaces (of this namespace) whose names carry this process's pid."""
    tag = str(os.getpid())
    namespaces = {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if tag in line}
    links = {line.split()[1].split("@")[0] for line in ip("-o", "link").stdout.splitlines() if tag in line}
    return namespaces, links


def test_hosts_reach_each_other_over_the_cable_and_are_gone_afterwards() -> None:
    namespaces_or_skip()
    with pytest.raises(RuntimeError, match="the body failed"):
        with TwoHosts() as hosts:
            server = listener(hosts.b, 9000)
            try:
                assert wait_until(lambda: connects(hosts.a.prefix, hosts.b.address, 9000), timeout=30)
                assert connects([], hosts.b.mgmt_address, 9000)     # this process, over the LAN
                hosts.link.set(up=False)
                assert not connects(hosts.a.prefix, hosts.b.address, 9000)
                assert connects([], hosts.b.mgmt_address, 9000)     # the LAN is not the cable
                hosts.link.set(up=True)
                assert connects(hosts.a.prefix, hosts.b.address, 9000)
            finally:
                server.kill()
                server.wait(timeout=10)
            assert ours() != (set(), set())
            raise RuntimeError("the body failed")
    assert ours() == (set(), set())


def test_namespaces_of_a_killed_run_are_reaped_with_their_processes() -> None:
    namespaces_or_skip()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"ndi-{dead.pid}-0a"
    ip("netns", "add", stale)
    left = subprocess.Popen(["ip", "netns", "exec", stale, sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        wait_until(lambda: ip("netns", "pids", stale).stdout.split() == [str(left.pid)], timeout=30)
        assert stale in reap_stale_namespaces()
        assert left.wait(timeout=10) == -9
        assert stale not in ip("netns", "list").stdout
    finally:
        left.kill()
        left.wait(timeout=10)
        ip("netns", "del", stale, check=False)
