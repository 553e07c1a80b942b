"""Write-back of a finished answer's KV between two in-process engines over real shm: the decode engine offers
the prompt's and the answer's full blocks to the prefill engine that served the prompt, the prefill engine pulls
the ones it lacks into its prefix cache, and a chat's next turn there computes only its new tokens, with answers
equal to a `both` engine's and every block freed on both sides."""
from __future__ import annotations

from typing import Iterator

import pytest

from common.handoff import DecodeParams
from common.kv_events import BlockStored
from neuron_connector import ProtocolError, WriteBack
from neuron_connector.protocol import decode_request
from scheduler import Sequence
from tests.di.engine_pair import Recorder, engine_trio, run_pair, tokens, wait_all_free
from tests.helpers import wait_until
from worker import LLMEngine, SamplingParams
from worker.engine import kv_write_back

NUM_BLOCKS = 256
BLOCK = 16


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    with engine_trio(NUM_BLOCKS, write_back="all") as trio:
        yield trio


def stored_hashes(engine: LLMEngine) -> list[int]:
    """Records the hashes `engine`'s prefix cache announces from here on (its real `on_event`)."""
    stored: list[int] = []
    engine.scheduler.block_manager.on_event = lambda event: stored.extend(
        event.block_hashes if isinstance(event, BlockStored) else ())
    return stored


@pytest.mark.parametrize("sampling, seed", [({"temperature": 0.0}, 1), ({"temperature": 0.9, "seed": 5}, 2)])
def test_the_next_turn_computes_only_its_new_tokens(engines, sampling: dict, seed: int) -> None:
    prefill, decode, both = engines
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    pulls = prefill.role.write_backs.counts
    cached_before = pulls.cached_blocks
    stored = stored_hashes(prefill)
    prompt: list[int] = []
    for turn, n in enumerate([70, 9, 40, 16]):
        previous, prompt = prompt, prompt + tokens(seed * 100 + turn, n)
        want = both.generate([prompt], [params])[0]
        with Recorder(prefill, decode) as rec:
            first, (got,) = run_pair(prefill, decode, [prompt], [params])
        assert got == want and first == [want[0]], f"turn {turn}"
        # The prefill engine holds every full block of the last turn's prompt and answer but the newest token.
        assert rec.prefill_starts == [min(max(len(previous) - 1, 0) // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK]
        wait_all_free(prefill, decode)   # the write-back pulled, or refused, and every block freed
        prompt = prompt + got
        full = (len(prompt) - 1) // BLOCK
        assert len(prefill.scheduler.block_manager.hash_to_block_id) >= full
    assert pulls.cached_blocks > cached_before and pulls.failed == 0
    assert len(stored) >= pulls.cached_blocks - cached_before   # announced as KV events, for KV-aware routing
    prefill.scheduler.block_manager.on_event = None


def test_a_next_turn_that_comes_during_the_write_back_waits_for_it(engines, monkeypatch) -> None:
    """The next turn reaches the prefill engine together with the last answer's offer: it waits for that pull
    instead of computing the answer again, and equals the `both` engine's. (This test steps both engines in a
    busy loop, which slows the buffers' threads: the hold is made long enough for any pull here.)"""
    monkeypatch.setattr(kv_write_back, "HOLD_S", 10.0)
    prefill, decode, both = engines
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompt = tokens(6000, 70)
    _, (answer,) = run_pair(prefill, decode, [prompt], [params])
    wait_until(prefill.kv_connector.has_write_backs, timeout=10, what="the offer of the answer's KV")
    previous, prompt = prompt + answer, prompt + answer + tokens(6001, 9)
    with Recorder(prefill, decode) as rec:
        first, (got,) = run_pair(prefill, decode, [prompt], [params])
    assert got == both.generate([prompt], [params])[0] and first == [got[0]]
    assert rec.prefill_starts == [(len(previous) - 1) // BLOCK * BLOCK]
    wait_all_free(prefill, decode)


def test_an_offer_of_blocks_the_prefill_holds_pulls_nothing(engines) -> None:
    prefill, decode, both = engines
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = tokens(4000, 3 * BLOCK + 1)   # the answer's first token fills no block: nothing new to write back
    offers, pulls = decode.role.write_backs.counts, prefill.role.write_backs.counts
    offered, cached, refused = offers.offered, pulls.cached_blocks, pulls.refused
    run_pair(prefill, decode, [prompt], [params])
    wait_all_free(prefill, decode)
    assert (offers.offered - offered, pulls.cached_blocks, pulls.refused) == (1, cached, refused)


@pytest.mark.parametrize("bad", ["not_whole_blocks", "withdrawn"])
def test_a_bad_or_withdrawn_offer_caches_nothing_and_frees_both_sides(engines, bad: str) -> None:
    """An offer whose tokens are not whole blocks and one more is refused; one the decode engine withdraws
    before the pull (its KV discarded) fails the pull. Either way nothing is cached and both engines free
    every block."""
    prefill, decode, both = engines
    prompt = tokens(5000 + len(bad), 4 * BLOCK)
    run_pair(prefill, decode, [prompt], [SamplingParams(max_tokens=1, ignore_eos=True)])
    wait_all_free(prefill, decode)
    held = Sequence(f"bad-{bad}", prompt, max_tokens=1, block_size=BLOCK)
    assert decode.scheduler.block_manager.take_cached(held) == 4
    other = prompt[:-1] + [prompt[-1] + 1]   # a last block the prefill engine lacks, so it would pull it
    offered = prompt[:-1] if bad == "not_whole_blocks" else other + [prompt[0]]
    pulls = prefill.role.write_backs.counts
    failed, refused, cached = pulls.failed, pulls.refused, pulls.cached_blocks
    decode.role.write_backs.hold(held, offered, DecodeParams("127.0.0.1", prefill.kv_connector.kv_port))
    if bad == "withdrawn":   # the offer has reached the prefill engine, which has not stepped to take it yet
        wait_until(prefill.kv_connector.has_write_backs, timeout=10, what="the offer of the answer's KV")
        decode.kv_connector.discard(held.request_id)
    wait_all_free(prefill, decode)
    assert (pulls.failed - failed, pulls.refused - refused) == ((0, 1) if bad == "not_whole_blocks" else (1, 0))
    assert pulls.cached_blocks == cached


def test_a_prefill_engine_without_write_back_is_offered_nothing() -> None:
    """Its handshake says it takes no write-backs, so the decode engine holds no blocks for a pull that would never
    come (they would stay pinned until the hand-back timeout)."""
    with engine_trio(NUM_BLOCKS, write_back="all", prefill_write_back="off") as (prefill, decode, both):
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
        prompt = tokens(7, 70)
        _, (got,) = run_pair(prefill, decode, [prompt], [params])
        assert got == both.generate([prompt], [params])[0]
        assert decode.role.write_backs.counts.offered == 0 and not decode.role.write_backs.holds_kv
        wait_all_free(prefill, decode)


def test_write_back_messages_round_trip_and_refuse_bad_fields() -> None:
    offer = WriteBack("r.write-back", "127.0.0.1", 5000, "decode-1", (1, 2, 3))
    assert decode_request(offer.to_bytes()) == offer
    for bad in (b'{"type":"write_back","request_id":"r","host":"h","port":0,"engine_id":"e","token_ids":[1,2]}',
                b'{"type":"write_back","request_id":"r","host":"h","port":5,"engine_id":"e","token_ids":[1]}',
                b'{"type":"write_back","request_id":"r","host":"","port":5,"engine_id":"e","token_ids":[1,2]}',
                b'{"type":"write_back","request_id":"r","host":"h","port":5,"engine_id":"e","token_ids":[1,-2]}'):
        with pytest.raises(ProtocolError):
            decode_request(bad)
