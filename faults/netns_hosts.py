"""Two "hosts" on this machine: Linux network namespaces joined by a cable whose faults we control.

    with TwoHosts() as hosts:                       # needs root and iproute2 (`ip`)
        a, b = hosts.a, hosts.b
        stack.start("decode worker", args, prefix=b.prefix)   # runs inside host b
        hosts.link.set(delay_ms=20, loss_pct=1)     # the cable between a and b only
        hosts.link.set(up=False)                    # cut it; up=True restores it

Layout (every name carries the creating process's pid and a serial, so parallel runs never meet):

    host a (netns ndi-PID-Na)                                       host b (netns ndi-PID-Nb)
      data 10.77.D.1 ──── cable (faults/netns_wire.py) ──── data 10.77.D.2
      mgmt 10.77.M.1 ─┐                                  ┌─ mgmt 10.77.M.2
                      └─── bridge in netns ndi-PID-Nlan ─┘
                                      │
                 this process: 10.77.M.254 (the one interface added to its namespace)

Processes on the hosts advertise their data address, so everything between a and b (HTTP
legs, the KV signal plane, KV blocks) crosses the cable and suffers its faults. The
management LAN lets this process, the test client, reach every host whatever the cable's
state: servers there listen on 0.0.0.0, and `host.mgmt_url(port)` is how to reach them.
The cable is a user-space frame copier rather than tc netem, which many kernels (ours
included) are built without; it gives netem's fixed delay and random loss. Leaving the context stops the cable and deletes the namespaces
and the interface it created (run processes on the hosts inside it and stop them first);
namespaces of runs that were killed are reaped on the next start.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Sequence

from stack.serving import ROOT

NS_PREFIX = "ndi-"
_SUBNETS = range(16, 240)   # third octet of the 10.77.x.0/24 networks we may use
_CMD_TIMEOUT_S = 20.0
_SERIALS = itertools.count()


class NetnsUnavailable(RuntimeError):
    """This machine or user cannot create network namespaces (not root, no iproute2, no TAP)."""


class NetnsError(RuntimeError):
    """A namespace, interface or the cable could not be set up or changed."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs `ip ARGS`; NetnsError with its stderr when it fails and `check`."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"ip {' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def check_available() -> None:
    """Raises NetnsUnavailable, saying why, unless this process can build a TwoHosts."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (this process is not)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed (scripts/bootstrap.sh --etcd installs it)")
    if not os.path.exists("/dev/net/tun"):
        raise NetnsUnavailable("/dev/net/tun is missing: the cable between hosts needs TAP devices")
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    done = ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"cannot create a network namespace: {done.stderr.strip()}")
    ip("netns", "del", probe, check=False)


def reap_stale_namespaces() -> list[str]:
    """Deletes our namespaces whose creating process is gone (a run killed before it cleaned up),
    killing the processes that run was running in them."""
    reaped = []
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{NS_PREFIX}(\d+)-\d+[a-z]+", name)
        if not match or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        ip("netns", "del", name, check=False)
        reaped.append(name)
    return reaped


@dataclass(frozen=True, slots=True)
class Host:
    """One network namespace: `address` on the cable, `mgmt_address` on the management LAN."""

    name: str
    netns: str
    address: str
    mgmt_address: str

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.netns]

    def mgmt_url(self, port: int) -> str:
        """A server of this host listening on 0.0.0.0:`port`, as this process reaches it."""
        return f"http://{self.mgmt_address}:{port}"


class Cable:
    """The running frame copier between the hosts' data devices."""

    def __init__(self, tap_a: str, tap_b: str) -> None:
        wire = ROOT / "faults" / "netns_wire.py"
        self._proc = subprocess.Popen([sys.executable, str(wire), tap_a, tap_b], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, start_new_session=True)
        if self._answer() != "ready":
            self.close()
            raise NetnsUnavailable("the cable could not create its TAP devices")

    def set(self, **state: object) -> None:
        """Sets any of delay_ms, loss_pct, up for both directions; NetnsError if refused."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(state) + "\n")
        self._proc.stdin.flush()
        answer = self._answer()
        if answer != "ok":
            raise NetnsError(f"the cable refused {state}: {answer}")

    def clear(self) -> None:
        """No delay, no loss, connected."""
        self.set(delay_ms=0, loss_pct=0, up=True)

    def _answer(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise NetnsError(f"the cable exited with status {self._proc.wait(timeout=_CMD_TIMEOUT_S)}")
        return line.strip()

    def close(self) -> None:
        """Closing its stdin ends the copier; it is killed if it does not end at once."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _free_subnets(count: int) -> list[int]:
    """Third octets of 10.77.x.0/24 networks that no route of this namespace touches."""
    used = [ipaddress.ip_network(word, strict=False) for word in ip("-4", "route", "show", "table", "all")
            .stdout.split() if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", word)]
    start = os.getpid() % len(_SUBNETS)
    order = [_SUBNETS[(start + i) % len(_SUBNETS)] for i in range(len(_SUBNETS))]
    free = [x for x in order if not any(ipaddress.ip_network(f"10.77.{x}.0/24").overlaps(n) for n in used)]
    if len(free) < count:
        raise NetnsError("no free 10.77.x.0/24 network for the hosts")
    return free[:count]


class TwoHosts:
    """Hosts `a` and `b`, the `link` between them, and the management LAN (a context manager)."""

    def __init__(self, mtu: int = 9000) -> None:
        self._mtu = mtu
        self._exit = ExitStack()
        serial = next(_SERIALS)  # several TwoHosts of one process get names of their own
        self._tag = f"{NS_PREFIX}{os.getpid()}-{serial}"
        self._if = f"nd{os.getpid()}{serial}"

    def __enter__(self) -> TwoHosts:
        check_available()
        reap_stale_namespaces()
        try:
            self._build()
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._exit.close()

    def _build(self) -> None:
        data, mgmt = _free_subnets(2)
        lan = self._netns("lan")
        ip("-n", lan, "link", "add", "br0", "type", "bridge")
        ip("-n", lan, "link", "set", "br0", "up")
        # The only interface in our own namespace; deleting its peer namespace deletes it too.
        root_if = f"{self._if}r"
        ip("link", "add", root_if, "type", "veth", "peer", "name", "lan-root", "netns", lan)
        self._exit.callback(ip, "link", "del", root_if, check=False)
        self._join_lan(lan, "lan-root")
        ip("addr", "add", f"10.77.{mgmt}.254/24", "dev", root_if)
        ip("link", "set", root_if, "up")
        taps = {"a": f"{self._if}a", "b": f"{self._if}b"}
        self.link = Cable(taps["a"], taps["b"])
        self._exit.callback(self.link.close)
        hosts = {}
        for i, name in enumerate(("a", "b"), start=1):
            netns = self._netns(name)
            ip("link", "set", taps[name], "netns", netns)
            ip("-n", netns, "link", "set", taps[name], "name", "data0")
            ip("-n", netns, "link", "set", "data0", "mtu", str(self._mtu), "up")
            ip("-n", netns, "addr", "add", f"10.77.{data}.{i}/24", "dev", "data0")
            ip("-n", lan, "link", "add", f"lan-{name}", "type", "veth", "peer", "name", "mgmt0", "netns", netns)
            self._join_lan(lan, f"lan-{name}")
            ip("-n", netns, "addr", "add", f"10.77.{mgmt}.{i}/24", "dev", "mgmt0")
            ip("-n", netns, "link", "set", "mgmt0", "up")
            hosts[name] = Host(name, netns, f"10.77.{data}.{i}", f"10.77.{mgmt}.{i}")
        self.a, self.b = hosts["a"], hosts["b"]

    def _netns(self, name: str) -> str:
        netns = f"{self._tag}{name}"
        ip("netns", "add", netns)
        self._exit.callback(ip, "netns", "del", netns, check=False)
        ip("-n", netns, "link", "set", "lo", "up")
        return netns

    @staticmethod
    def _join_lan(lan: str, port: str) -> None:
        ip("-n", lan, "link", "set", port, "master", "br0")
        ip("-n", lan, "link", "set", port, "up")

    @property
    def hosts(self) -> Sequence[Host]:
        return (self.a, self.b)
