"""Prompts with image embeddings in the engine: logits equal transformers' `inputs_embeds`, whole or
chunked, and the prefix cache shares blocks of identical images only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.multimodal_helpers import embeds
from tests.worker.test_parity import engine_for, hf_model
from worker import LLMEngine, SamplingParams
from worker.errors import InvalidRequestError
from worker.multimodal.embeds import ImageEmbeds
from worker.multimodal.prompt import PLACEHOLDER_TOKEN_ID

HIDDEN = 64   # the tiny checkpoints' hidden size
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompt_with(images: list[ImageEmbeds], texts: list[list[int]]) -> tuple[list[int], list[tuple[int, ImageEmbeds]]]:
    """texts[0] image[0] texts[1] image[1] ... texts[-1], as token ids and (start, embeds) spans."""
    ids, spans = list(texts[0]), []
    for image, text in zip(images, texts[1:]):
        spans.append((len(ids), image))
        ids += [PLACEHOLDER_TOKEN_ID] * image.num_positions + text
    return ids, spans


def hf_logits(model, ids: list[int], spans: list[tuple[int, ImageEmbeds]]) -> torch.Tensor:
    """transformers' logits for the prompt whose image positions take the images' rows as inputs_embeds."""
    with torch.no_grad():
        inputs = model.get_input_embeddings()(torch.tensor(ids)).clone()
        for start, image in spans:
            inputs[start:start + image.num_positions] = image.tensor
        return model(inputs_embeds=inputs[None]).logits[0].float()


def ours_logits(engine: LLMEngine) -> list[tuple[object, torch.Tensor]]:
    """Runs the engine's scheduled steps to the end; each step's chunks with the logits of their rows."""
    out = []
    while not engine.scheduler.is_finished():
        step = engine.scheduler.schedule()
        inputs = engine.runner.prepare(step)
        with torch.inference_mode():
            hidden = engine.runner.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.input_rows)
            logits = engine.runner.model.compute_logits(hidden)
        rows = logits.split([c.num_tokens for c in step.chunks])
        out += list(zip(step.chunks, rows))
        engine.scheduler.postprocess(step.sampled, [int(r[-1].argmax()) for c, r in zip(step.chunks, rows)
                                                    if c.samples])
    return out


TEXTS = [[256, 60, 61, 62, 63, 64], [70, 71, 72], [80, 81, 82, 83, 84]]


@pytest.mark.parametrize("budget", [None, 5, 16], ids=["whole", "tiny-chunks", "block-chunks"])
def test_logits_with_images_match_transformers_inputs_embeds(tiny_llama: Path, budget: int | None) -> None:
    hf = hf_model(tiny_llama)
    chunking = {"enable_chunked_prefill": False} if budget is None else \
        {"enable_chunked_prefill": True, "max_num_batched_tokens": budget, "max_num_seqs": 4}
    engine = engine_for(tiny_llama, **chunking)
    prompts = [prompt_with([embeds(7, HIDDEN, 1), embeds(3, HIDDEN, 2)], TEXTS),
               prompt_with([embeds(9, HIDDEN, 3)], [[256, 90], [91, 92, 93]])]
    for i, (ids, spans) in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY, mm=spans)
    expected_all = [hf_logits(hf, ids, spans) for ids, spans in prompts]   # causal: row p sees rows <= p only
    started_inside_an_image = False
    for chunk, got in ours_logits(engine):
        index = int(chunk.seq.request_id[1:])
        ids, spans = prompts[index]
        end = chunk.start + chunk.num_tokens
        if end > len(ids):
            continue   # a decode: its inputs are tokens
        started_inside_an_image |= any(s < chunk.start < s + e.num_positions for s, e in spans)
        expected = expected_all[index][chunk.start:end]
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (chunk, (got - expected).abs().max())
    assert started_inside_an_image == (budget is not None)


def test_images_replace_the_placeholder_rows(tiny_llama: Path) -> None:
    """Without its images the same prompt's logits differ: the rows really come from the embeddings."""
    ids, spans = prompt_with([embeds(7, HIDDEN, 1)], TEXTS[:2])
    first = hf_logits(hf_model(tiny_llama), ids, spans)
    plain = hf_logits(hf_model(tiny_llama), ids, [])
    assert not torch.allclose(first[-1], plain[-1], atol=1e-3)


def run_one(engine: LLMEngine, request_id: str, ids: list[int], spans: list) -> tuple[int, list[int]]:
    """(prompt tokens served from the prefix cache, output tokens) of one request run alone."""
    engine.add_request(request_id, ids, GREEDY, mm=spans)
    cached: int | None = None
    tokens: list[int] = []
    while True:
        step = engine.scheduler.schedule()
        cached = step.chunks[0].start if cached is None else cached   # the prefill starts after the cached blocks
        token_ids = engine.runner.run(step).token_ids
        engine.scheduler.postprocess(step.sampled, token_ids)
        tokens += token_ids
        if engine.scheduler.is_finished():
            return cached, tokens


def test_prefix_cache_shares_blocks_of_the_same_image_only(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama, enable_chunked_prefill=False)   # block size 4
    text = [[256, 60, 61, 62, 63, 64, 65, 66], [70, 71, 72, 73, 74]]   # 8 tokens, image at 8..15, 5 tokens
    ids, first = prompt_with([embeds(8, HIDDEN, 1)], text)
    same_ids, same = prompt_with([embeds(8, HIDDEN, 1)], text)
    other_ids, other = prompt_with([embeds(8, HIDDEN, 2)], text)
    assert ids == same_ids == other_ids and first[0][1].digest == same[0][1].digest != other[0][1].digest
    cached, out = run_one(engine, "a", ids, first)
    assert cached == 0
    assert run_one(engine, "b", ids, same) == (20, out)     # all 5 full blocks reused (image ones too), same tokens
    cached, out_other = run_one(engine, "c", ids, other)
    assert cached == 8                                       # the text blocks only
    assert out_other != out
    assert engine.stats().num_blocks_used == 0


@pytest.mark.parametrize("spans, message", [
    (lambda e: [(20, e)], "must lie in the prompt"),
    (lambda e: [(0, e), (2, e)], "after the previous image"),
    (lambda e: [(0, embeds(3, 32, 1))], "do not fit the model"),
])
def test_bad_spans_are_refused(tiny_llama: Path, spans, message: str) -> None:
    engine = engine_for(tiny_llama)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("x", [256] + [PLACEHOLDER_TOKEN_ID] * 10, GREEDY, mm=spans(embeds(3, HIDDEN, 1)))
    assert not engine.has_unfinished_requests()
