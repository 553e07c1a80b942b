"""Who counts as the same host for shm: one boot, one network namespace, one IPC namespace.

Network namespaces on one machine share the hostname, the boot id and /dev/shm, yet their
processes reach each other at other addresses, as separate hosts do: `auto` must pick tcp
between them, never shm.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from transfer.region import host_identity

PRINT_KEY = "from transfer.region import host_identity; print(host_identity())"


def child_key(*prefix: str) -> str:
    """host_identity() as a child process started under `prefix` sees it."""
    done = subprocess.run([*prefix, sys.executable, "-c", PRINT_KEY], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot start a child under {' '.join(prefix)}: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def test_processes_of_one_namespace_are_one_host() -> None:
    assert child_key() == host_identity()


@pytest.mark.parametrize("kind, flag", [("net", "--net"), ("ipc", "--ipc")])
def test_another_namespace_is_another_host(kind: str, flag: str) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("util-linux `unshare` is not installed")
    ours, theirs = host_identity(), child_key("unshare", flag)
    assert ours != theirs
    # Only that namespace's part differs: same boot, same other namespace.
    differing = [a.split(":")[0] for a, b in zip(ours.split("/"), theirs.split("/")) if a != b]
    assert differing == [kind]


def test_auto_reaches_a_peer_in_another_network_namespace_over_tcp(make_engine) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("util-linux `unshare` is not installed")
    engine, far, near = make_engine("auto", seed=1), make_engine("auto"), make_engine("auto")
    elsewhere = {**far.descriptor(), "host_id": child_key("unshare", "--net")}
    assert engine.peer_backend(engine.connect(elsewhere)) == "tcp"
    assert engine.peer_backend(engine.connect(near.descriptor())) == "shm"
