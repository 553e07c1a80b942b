"""Both kv_protocols: both legs share one seed, and decode's first token is checked against prefill's."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.proxy.conftest import Pair

PROTOCOLS = ["neuron", "nixl"]


def _pair(request: pytest.FixtureRequest, protocol: str) -> Pair:
    return request.getfixturevalue("pair" if protocol == "neuron" else "nixl_pair")


def _post(pair: Pair, stream: bool, **extra: Any) -> httpx.Response:
    body = {"model": "fake-model", "prompt": "seeded", "max_tokens": 4, "stream": stream, **extra}
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200
    return reply


def _uid(reply: httpx.Response, stream: bool) -> str:
    data = json.loads(reply.text.split("data: ", 1)[1].split("\n", 1)[0]) if stream else reply.json()
    return data["id"].removeprefix("cmpl-")


def _seeds(pair: Pair, uid: str) -> list[int | None]:
    return [leg["body"].get("seed") for server in (pair.prefill, pair.decode)
            for leg in server.state()["legs"] if leg["uid"] == uid]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_both_legs_get_the_clients_seed_or_one_drawn_for_the_request(request: pytest.FixtureRequest,
                                                                     protocol: str) -> None:
    pair = _pair(request, protocol)
    assert _seeds(pair, _uid(_post(pair, False, seed=1234), False)) == [1234, 1234]
    drawn = _seeds(pair, _uid(_post(pair, True), True))
    assert len(drawn) == 2 and drawn[0] == drawn[1] and 0 <= drawn[0] < 2**31
    # Greedy needs no seed (and vLLM's CPU build fails seeded requests prefilled in chunks).
    assert _seeds(pair, _uid(_post(pair, False, temperature=0), False)) == [None, None]


@pytest.mark.parametrize("seed", ["7", True, 1.5])
def test_a_seed_that_is_not_an_int_is_400(pair: Pair, seed: Any) -> None:
    before = len(pair.prefill.state()["legs"]), len(pair.decode.state()["legs"])
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", timeout=10,
                       json={"model": "fake-model", "prompt": "x", "max_tokens": 4, "seed": seed})
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "'seed' must be of type int", "type": "invalid_request_error",
                                     "param": "seed", "code": 400}
    assert (len(pair.prefill.state()["legs"]), len(pair.decode.state()["legs"])) == before


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 2**100])
def test_a_seed_outside_int64_is_400_naming_seed(pair: Pair, seed: int) -> None:
    before = len(pair.prefill.state()["legs"]), len(pair.decode.state()["legs"])
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", timeout=10,
                       json={"model": "fake-model", "prompt": "x", "max_tokens": 4, "seed": seed})
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "'seed' must be an int in [-2**63, 2**63)",
                                     "type": "invalid_request_error", "param": "seed", "code": 400}
    assert (len(pair.prefill.state()["legs"]), len(pair.decode.state()["legs"])) == before


def _first_token_counters(pair: Pair, protocol: str) -> tuple[float, float]:
    metrics = httpx.get(f"{pair.proxy.url}/metrics", timeout=10).text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("proxy_first_token_")}
    label = f'{{kv_protocol="{protocol}"}}'
    return values[f"proxy_first_token_checks_total{label}"], values[f"proxy_first_token_mismatches_total{label}"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_different_first_token_from_decode_is_counted(request: pytest.FixtureRequest, protocol: str,
                                                        stream: bool) -> None:
    pair = _pair(request, protocol)
    checks, mismatches = _first_token_counters(pair, protocol)
    _post(pair, stream)
    assert _first_token_counters(pair, protocol) == (checks + 1, mismatches)
    _post(pair, stream, fake={"decode": {"first_token": " other"}})
    assert _first_token_counters(pair, protocol) == (checks + 2, mismatches + 1)
    other = "nixl" if protocol == "neuron" else "neuron"
    assert _first_token_counters(pair, other) == (0, 0)
