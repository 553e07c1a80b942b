"""`python -m planner`: a bad target, budget, bound or connector setting stops it at start, naming it."""
from __future__ import annotations

import pytest

from planner.cli import parse_args

BASE = ["--etcd", "127.0.0.1:2379", "--proxy-url", "http://127.0.0.1:8000", "--ttft-target-ms", "2000",
        "--itl-target-ms", "100", "--budget", "6", "--connector", "flip"]


def with_flag(flag: str, value: str) -> list[str]:
    argv = list(BASE)
    argv[argv.index(flag) + 1] = value
    return argv


@pytest.mark.parametrize("argv, message", [
    (with_flag("--budget", "1"), "--budget must be an integer of at least 2"),
    (with_flag("--ttft-target-ms", "-5"), "--ttft-target-ms must be a positive number, got -5"),
    (with_flag("--itl-target-ms", "2"), "--itl-target-ms 2 is below the decode step time of one sequence"),
    (BASE + ["--min-prefill", "4", "--min-decode", "3"], "--budget 6 is less than --min-prefill 4 plus --min-decode 3"),
    (BASE + ["--max-decode", "9"], "--max-decode must be between its minimum 1 and --budget 6, got 9"),
    (with_flag("--etcd", "nohost"), "--etcd must be host:port, got 'nohost'"),
    (with_flag("--proxy-url", "127.0.0.1:8000"), "--proxy-url must be an http(s) URL"),
    (with_flag("--connector", "local"), "--connector local needs --worker-command"),
    (with_flag("--connector", "local") + ["--worker-command", "python -m worker --role {role}"],
     "must place the worker's HTTP port with {port}"),
])
def test_a_bad_setting_is_a_start_up_error_naming_it(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_good_settings_parse() -> None:
    args, config = parse_args(BASE)
    assert config.budget == 6 and config.ttft_target_s == 2.0 and args.connector == "flip"
