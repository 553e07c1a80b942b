"""Static xPyD from the command line: each decode leg names the prefill worker it was paired with."""
from __future__ import annotations

from typing import Callable

import httpx

from tests.proxy.conftest import Server, start_fake_worker, start_proxy


def test_static_xpyd_pairs_each_decode_leg_with_its_prefill(servers: Callable[[Server], Server]) -> None:
    first, second = (servers(start_fake_worker("prefill")) for _ in range(2))
    decode = servers(start_fake_worker("decode"))
    proxy = servers(start_proxy([f"--prefill=127.0.0.1:{first.port}:15001", f"--prefill=127.0.0.1:{second.port}",
                                 f"--decode=127.0.0.1:{decode.port}"]))
    with httpx.Client(timeout=30) as client:
        for i in range(4):
            reply = client.post(f"{proxy.url}/v1/completions",
                                json={"model": "fake-model", "prompt": f"p{i}", "max_tokens": 2})
            assert reply.status_code == 200
    kv_port = {first.port: 15001, second.port: 14579}
    for prefill in (first, second):
        uids = {leg["uid"] for leg in prefill.state()["legs"]}
        assert len(uids) == 2
        for leg in decode.state()["legs"]:
            if leg["uid"] in uids:
                params = leg["kv_transfer_params"]
                assert "remote_engine_id" not in params   # a static prefill's engine id is unknown
                assert params["remote_port"] == kv_port[prefill.port]
