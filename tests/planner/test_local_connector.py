"""The local connector's faults: a worker that fails to start is retried after a backoff that doubles, and
starts never push the fleet past the budget. The command template is checked up front."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from common.worker_record import WorkerRecord
from planner.actions import Action
from planner.connectors.local import LocalConnector, check_template
from planner.errors import ConfigError

FAILS = f"{sys.executable} -c 'import sys; sys.exit(3)' {{role}} {{port}}"


class FakeEtcd:
    host, port = "127.0.0.1", 2379

    def __init__(self, records: list[WorkerRecord]) -> None:
        self.records = records

    async def read(self) -> list[WorkerRecord]:
        return self.records


def test_a_failing_worker_is_retried_with_backoff_within_the_budget(tmp_path: Path) -> None:
    etcd = FakeEtcd([WorkerRecord("prefill", "127.0.0.1", 9001), WorkerRecord("decode", "127.0.0.1", 9002)])
    connector = LocalConnector(etcd, FAILS, budget=3, start_timeout_s=30, flipper=None,   # type: ignore[arg-type]
                               log_dir=str(tmp_path))

    async def scenario() -> None:
        await connector.apply([Action("start", "decode"), Action("start", "decode")])
        assert len(connector.starting) == 1   # the second would pass the budget of 3
        assert (await connector.fleet()).counts().total == 3

        async def failed() -> bool:
            await connector.progress()
            return not connector.starting
        while not await failed():
            await asyncio.sleep(0.05)
        assert connector.failures == 1 and connector.next_start_at > time.time() + 1
        await connector.apply([Action("start", "decode")])
        assert not connector.starting   # backing off
        connector.next_start_at = time.time()
        await connector.apply([Action("start", "decode")])
        while not await failed():
            await asyncio.sleep(0.05)
        assert connector.failures == 2
        assert connector.next_start_at - time.time() == pytest.approx(4.0, abs=0.5)   # doubled
        await connector.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("template, problem", [
    ("python -m worker --role {role}", "must place the worker's HTTP port"),
    ("python -m worker --port {port} --nope {nope}", "KeyError"),
    ("python -m worker --port {port} 'unclosed", "ValueError"),
])
def test_a_bad_template_is_a_config_error_naming_the_flag(template: str, problem: str) -> None:
    with pytest.raises(ConfigError, match="--worker-command") as info:
        check_template(template)
    assert problem in str(info.value)


