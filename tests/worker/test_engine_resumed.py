"""An answer resumed on another engine from its first k tokens goes on as the uninterrupted answer."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.stream_resume import Resumed
from tests.worker.test_engine import engine, prompts, run_all
from worker import LLMEngine, RequestOutput, SamplingParams
from worker.errors import InvalidRequestError

CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
    "penalised": SamplingParams(max_tokens=24, temperature=0.8, seed=3, repetition_penalty=1.3,
                                frequency_penalty=0.5, min_tokens=12, ignore_eos=True),
}


def _outputs(eng: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
             resumed: tuple[int, ...] = (), text_chars: int | None = None) -> list[RequestOutput]:
    eng.add_request(request_id, prompt, params, resumed=Resumed(resumed, text_chars))
    return [out for out in run_all(eng) if out.request_id == request_id]


@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_answer_goes_on_token_for_token(tiny_llama: Path, case: str) -> None:
    eng, prompt, params = engine(tiny_llama), prompts(1, seed=5)[0], CASES[case]
    whole = _outputs(eng, "whole", prompt, params)
    ids = [out.new_token_ids[0] for out in whole]
    for k in (1, 5, 17):
        rest = _outputs(engine(tiny_llama), f"resumed-{k}", prompt, params, tuple(ids[:k]))
        assert [out.new_token_ids[0] for out in rest] == ids[k:]
        assert "".join(out.text_delta for out in rest) == "".join(out.text_delta for out in whole[k:])
        assert (rest[-1].finish_reason, rest[-1].num_output_tokens) == (whole[-1].finish_reason, len(ids))


def test_a_stop_string_across_the_move_still_stops(tiny_llama: Path) -> None:
    eng, prompt = engine(tiny_llama), prompts(1, seed=9)[0]
    free = _outputs(eng, "free", prompt, CASES["greedy"])
    text = "".join(out.text_delta for out in free)
    stop = text[6:9]  # ends the answer within its first tokens' text
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    whole = _outputs(eng, "whole", prompt, params)
    ids = [out.new_token_ids[0] for out in whole]
    assert len(ids) > 3
    rest = _outputs(eng, "resumed", prompt, params, tuple(ids[:3]))
    assert "".join(out.text_delta for out in whole[:3] + rest) == "".join(out.text_delta for out in whole)
    assert (rest[-1].finish_reason, rest[-1].stop_reason) == ("stop", stop)


def test_text_the_client_never_got_comes_first_on_the_resuming_worker(tiny_llama: Path) -> None:
    """The worker that began the answer held some of its tokens' text back (a stop string's possible start, part
    of a character, a move before decode repeated prefill's token): the resuming one shows it with its first token."""
    eng, prompt, params = engine(tiny_llama), prompts(1, seed=5)[0], CASES["greedy"]
    whole = _outputs(eng, "whole", prompt, params)
    ids, text = [out.new_token_ids[0] for out in whole], "".join(out.text_delta for out in whole)
    shown = "".join(out.text_delta for out in whole[:5])
    assert len(shown) >= 2
    for client_has in (0, len(shown) - 1, len(shown)):
        rest = _outputs(engine(tiny_llama), f"held-{client_has}", prompt, params, tuple(ids[:5]), client_has)
        assert [out.new_token_ids[0] for out in rest] == ids[5:]
        assert text[:client_has] + "".join(out.text_delta for out in rest) == text


def test_resumed_outputs_must_leave_something_to_generate(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request("r", prompts(1)[0], SamplingParams(max_tokens=2), resumed=Resumed((5, 6)))
    with pytest.raises(InvalidRequestError, match="token ids"):
        eng.add_request("r", prompts(1)[0], SamplingParams(max_tokens=8), resumed=Resumed((10**9,)))
