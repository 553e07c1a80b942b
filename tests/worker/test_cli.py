"""`python -m worker` as a new user meets it: --help shows every default, ports default by role, and a port
in use (HTTP or KV) stops the worker at once with one line naming it, exit status 1 (no abort, no traceback)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from common.roles import DEFAULT_HTTP_PORTS
from proxy.config import build_parser as proxy_parser
from stack.serving import free_port
from tests.helpers import ROOT
from worker.server.cli import build_parser as worker_parser, parse_args


@pytest.mark.parametrize("parser", [worker_parser, proxy_parser], ids=["worker", "proxy"])
def test_help_shows_the_default_of_every_option_that_has_one(parser) -> None:
    unsaid = [action.option_strings[0] for action in parser()._actions
              if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
              and "default" not in (action.help or "")]
    assert unsaid == []
    undocumented = [action.option_strings[0] for action in parser()._actions
                    if action.option_strings and not action.help]
    assert undocumented == []


def test_each_role_has_its_own_default_port() -> None:
    assert {role: parse_args(["--role", role])[0].port for role in ("both", "prefill", "decode")} == {
        "both": 8000, "prefill": 8100, "decode": 8200}
    assert DEFAULT_HTTP_PORTS["encode"] == 8300
    assert parse_args(["--role", "decode", "--port", "9000"])[0].port == 9000


def _worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_an_http_port_in_use_stops_the_worker_before_it_loads_the_model(taken_port: int) -> None:
    result = _worker("--role", "decode", "--port", str(taken_port))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().endswith(f"ERROR worker: worker failed: cannot listen on 127.0.0.1:{taken_port}: "
                                          "Address already in use (another server listens there; pick another --port)")
    assert "Traceback" not in result.stderr and "starting the engine" not in result.stderr


def test_a_kv_port_in_use_stops_the_worker_with_one_line(taken_port: int) -> None:
    result = _worker("--role", "prefill", "--port", str(free_port()), "--kv-port", str(taken_port))
    assert result.returncode == 1, result.stderr  # not 134: nothing aborts on the way out
    assert result.stderr.strip().endswith(
        f"worker failed: engine failed to start: KV connector (auto) failed to start: cannot bind the KV signal plane "
        f"on 127.0.0.1:{taken_port}: Address already in use (another process listens there; pick another KV port)")
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr


def test_kv_events_config_is_vllms_json(capsys: pytest.CaptureFixture[str]) -> None:
    args, _ = parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6001"}'])
    assert args.kv_events.endpoint == "tcp://*:6001" and parse_args([])[0].kv_events is None
    with pytest.raises(SystemExit) as exc:
        parse_args(["--kv-events-config", "{not json"])
    assert exc.value.code == 2 and "--kv-events-config is not JSON" in capsys.readouterr().err


def test_a_hand_back_kv_port_is_for_a_worker_that_decodes_and_hands_streams_or_answers_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    decode = ["--role", "decode", "--drain-hands-back-streams"]
    assert parse_args([*decode, "--hand-back-kv-port", "0"])[0].hand_back_kv_port == 0
    assert parse_args(decode)[0].hand_back_kv_port is None
    # A prefill worker may change role to decode: its decode engine then holds handed-back streams' KV.
    assert parse_args(["--role", "prefill", "--drain-hands-back-streams", "--hand-back-kv-port", "0"])[0] \
        .hand_back_kv_port == 0
    # Write-back (on by default) waits on the same plane: a firewalled decode worker can name its port.
    assert parse_args(["--role", "decode", "--hand-back-kv-port", "14700"])[0].hand_back_kv_port == 14700
    for wrong in (["--role", "decode", "--kv-write-back", "off", "--hand-back-kv-port", "0"],
                  ["--role", "both", "--drain-hands-back-streams", "--hand-back-kv-port", "0"],
                  [*decode, "--hand-back-kv-port", "70000"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(wrong)
        assert exc.value.code == 2 and "--hand-back-kv-port" in capsys.readouterr().err


def test_kv_write_back_is_for_prefill_and_decode_workers(capsys: pytest.CaptureFixture[str]) -> None:
    for role in ("prefill", "decode"):
        assert parse_args(["--role", role])[0].kv_write_back == "chats"   # the default
        assert parse_args(["--role", role, "--kv-write-back"])[0].kv_write_back == "all"
        assert parse_args(["--role", role, "--kv-write-back", "off"])[0].kv_write_back == "off"
    for argv in (["--role", "both", "--kv-write-back"], ["--role", "decode", "--kv-write-back", "some"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2 and "--kv-write-back" in capsys.readouterr().err
