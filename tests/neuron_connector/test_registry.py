from __future__ import annotations

import json
import shutil
import tempfile

import pytest

from neuron_connector import Registration, RegistrationError, WorkerRecord
from stack.etcd import EtcdServer, etcd_args, etcd_binary
from stack.serving import Process, free_port
from tests.helpers import wait_until
from tests.proxy.registration import registered_workers


def _record(role: str = "prefill", http_port: int = 8100) -> WorkerRecord:
    return WorkerRecord(role=role, host="127.0.0.1", http_port=http_port, kv_host="127.0.0.1",
                        kv_port=14579, engine_id=f"{role}-{http_port}",
                        transfer={"engine_id": f"{role}-{http_port}", "transports": {}}, model="tiny")


def _keys(endpoint: str, role: str | None = None) -> list[str]:
    return [r.key for r in registered_workers(endpoint, role)]


def test_key_appears_with_the_json_and_disappears_on_stop(etcd_server: EtcdServer) -> None:
    record = _record()
    registration = Registration(etcd_server.endpoint, record, ttl=5)
    registration.start()
    try:
        assert registered_workers(etcd_server.endpoint) == [record]
        assert json.loads(record.to_json()) == {
            "role": "prefill", "host": "127.0.0.1", "http_port": 8100, "kv_host": "127.0.0.1",
            "kv_port": 14579, "engine_id": "prefill-8100",
            "transfer": {"engine_id": "prefill-8100", "transports": {}}, "model": "tiny", "kv_protocol": "neuron",
            "status_port": 0, "server": "", "kv_secret_id": "", "dtype": "", "kv_events": ""}
        assert record.key == "/workers/prefill/127.0.0.1/8100"
    finally:
        registration.stop()
    # Revoking the lease deletes the key at once: no polling needed.
    assert registered_workers(etcd_server.endpoint) == []
    registration.stop()   # idempotent


def test_workers_are_filed_under_their_role(etcd_server: EtcdServer) -> None:
    regs = [Registration(etcd_server.endpoint, _record(role, port), ttl=5)
            for role, port in (("prefill", 8100), ("decode", 8200), ("decode", 8201))]
    for reg in regs:
        reg.start()
    try:
        assert _keys(etcd_server.endpoint, "decode") == ["/workers/decode/127.0.0.1/8200",
                                                         "/workers/decode/127.0.0.1/8201"]
        assert _keys(etcd_server.endpoint, "prefill") == ["/workers/prefill/127.0.0.1/8100"]
        assert len(_keys(etcd_server.endpoint)) == 3
    finally:
        for reg in regs:
            reg.stop()


def test_lease_is_kept_alive_beyond_its_ttl(etcd_server: EtcdServer) -> None:
    registration = Registration(etcd_server.endpoint, _record(), ttl=2)
    registration.start()
    try:
        lease = registration.lease_id
        # Refreshes come every ttl/3: after 7 of them more than 2 TTLs have passed, and
        # without them the key would have expired.
        wait_until(lambda: registration.refreshes >= 7, timeout=30, what="7 keep-alive refreshes")
        assert _keys(etcd_server.endpoint) == ["/workers/prefill/127.0.0.1/8100"]
        assert registration.lease_id == lease and registration.registrations == 1
    finally:
        registration.stop()


def test_unreachable_etcd_is_a_registration_error() -> None:
    registration = Registration(f"127.0.0.1:{free_port()}", _record(), ttl=2)
    with pytest.raises(RegistrationError, match="etcd"):
        registration.start()


def test_bad_endpoint_and_record() -> None:
    with pytest.raises(RegistrationError, match="host:port"):
        Registration("localhost", _record())
    with pytest.raises(RegistrationError, match="malformed"):
        WorkerRecord.from_json(b'{"role": "prefill"}')
    with pytest.raises(ValueError, match="role"):
        _record(role="router")


def test_killed_process_vanishes_within_ttl(etcd_server: EtcdServer) -> None:
    proc = Process("register-demo", ["-m", "tests.neuron_connector.register_demo", "--etcd", etcd_server.endpoint,
                                     "--role", "decode", "--http-port", "8200", "--kv-port", "14600",
                                     "--ttl", "2"])
    try:
        wait_until(lambda: "registered" in proc.output(), timeout=30, what="registration")
        records = registered_workers(etcd_server.endpoint)
        assert [(r.role, r.http_port, r.kv_port, r.engine_id) for r in records] == [
            ("decode", 8200, 14600, "decode-127.0.0.1-8200")]
        proc.kill()
        # TTL 2 s plus etcd's expiry sweep: it must vanish well within 2 + 5 s.
        wait_until(lambda: registered_workers(etcd_server.endpoint) == [], timeout=7,
                   what="the lease of the killed process to expire")
    finally:
        proc.stop()


def test_demo_unregisters_on_sigterm(etcd_server: EtcdServer) -> None:
    proc = Process("register-demo", ["-m", "tests.neuron_connector.register_demo", "--etcd", etcd_server.endpoint,
                                     "--role", "prefill", "--http-port", "8101", "--ttl", "30"])
    try:
        wait_until(lambda: "registered" in proc.output(), timeout=30, what="registration")
        assert _keys(etcd_server.endpoint) == ["/workers/prefill/127.0.0.1/8101"]
        proc.stop()
        assert proc.proc.returncode == 0, proc.output()
        assert "unregistered" in proc.output()
        assert _keys(etcd_server.endpoint) == []   # revoked, not waiting for a 30 s TTL
    finally:
        proc.stop()


def _fresh_etcd_on(port: int) -> tuple[Process, str]:
    """An etcd with empty data on a given client port: the old one's leases are gone."""
    data_dir = tempfile.mkdtemp(prefix="etcd-")
    return Process("etcd-again", etcd_args("again", data_dir, port), program=etcd_binary()), data_dir


def test_reregisters_under_a_new_lease_after_etcd_comes_back(etcd_server: EtcdServer) -> None:
    registration = Registration(etcd_server.endpoint, _record(), ttl=1)
    registration.start()
    again, data_dir = None, None
    try:
        etcd_server.process.stop()
        wait_until(lambda: registration.failures >= 1, timeout=20, what="a failed keep-alive")
        again, data_dir = _fresh_etcd_on(etcd_server.port)
        wait_until(lambda: registration.registrations >= 2, timeout=30, what="re-registration")
        assert _keys(etcd_server.endpoint) == ["/workers/prefill/127.0.0.1/8100"]
    finally:
        registration.stop()
        if again is not None:
            again.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
