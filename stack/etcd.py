"""A real etcd on free ports, its data in a temporary directory: for tests, the fault campaign and examples."""
from __future__ import annotations

import shutil
import tempfile
from typing import Sequence

from stack.serving import Process, StackError, free_port, port_was_taken, wait_healthy


def etcd_binary() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        raise StackError("etcd is not on PATH (Debian: apt-get install etcd-server)")
    return binary


def etcd_args(name: str, data_dir: str, port: int, hosts: Sequence[str] = ("127.0.0.1",)) -> list[str]:
    """A one-member etcd named `name` serving clients on `port` of every address of `hosts` (advertising
    the first), its peers on a free port of the first."""
    peer_url = f"http://{hosts[0]}:{free_port()}"
    return ["--name", name, "--data-dir", data_dir,
            "--listen-client-urls", ",".join(f"http://{host}:{port}" for host in hosts),
            "--advertise-client-urls", f"http://{hosts[0]}:{port}",
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{name}={peer_url}"]


class EtcdServer:
    """A started etcd, on 127.0.0.1 unless `hosts` says where; `stop()` ends it and removes its data.

    It serves clients on every address of `hosts`: `endpoint` is on the first, and its health is
    probed on the last, which this process must reach. `prefix` runs it through a launcher that
    execs it (e.g. `ip netns exec NAME`).
    """

    def __init__(self, hosts: Sequence[str] = ("127.0.0.1",), prefix: Sequence[str] = (),
                 timeout_s: float = 20.0, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):   # a port taken before etcd bound it: again, on new ports
            self.data_dir = tempfile.mkdtemp(prefix="neuron-di-etcd-")
            self.port = free_port()
            self.endpoint = f"{hosts[0]}:{self.port}"
            try:
                self.process = Process("etcd", etcd_args("etcd", self.data_dir, self.port, hosts),
                                       program=etcd_binary(), prefix=prefix)
                wait_healthy(f"http://{hosts[-1]}:{self.port}/health", [self.process], timeout_s)
                return
            except BaseException as exc:
                self.stop()
                if not isinstance(exc, StackError) or not port_was_taken(exc) or attempt == attempts:
                    raise

    def stop(self) -> None:
        if hasattr(self, "process"):
            self.process.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
