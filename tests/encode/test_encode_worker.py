"""The encode worker alone (a real `python -m worker --role encode`), pulled from by this process's own
region of rows through the real transfer engine."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from tests.encode.embeds_files import HIDDEN, rows, write_images
from tests.helpers import wait_until
from tests.worker_process import WorkerProcess
from worker.multimodal.errors import EmbedsTransferError
from worker.multimodal.fetch import EmbedsFetcher
from worker.multimodal.ref import EmbedsRef
from worker.multimodal.rows import RowRegion
from worker.multimodal.embeds import digest


@pytest.fixture(scope="module", params=["shm", "tcp"])
def encoder(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, Path]]:
    media = tmp_path_factory.mktemp("media")
    worker = WorkerProcess("encode", request.param, extra=["--allowed-local-media-path", str(media),
                                                           "--embeds-ttl", "2", "--embeds-region-mb", "1"])
    try:
        yield worker, media
    finally:
        worker.stop()


def _encode(worker: WorkerProcess, urls: list[str]) -> httpx.Response:
    parts = [{"part": f"messages[0].content[{i}]", "url": url} for i, url in enumerate(urls)]
    return httpx.post(f"{worker.url}/v1/encode", json={"parts": parts}, timeout=30)


def _held(worker: WorkerProcess) -> int:
    return httpx.get(f"{worker.url}/health", timeout=10).json()["held_parts"]


async def _fetch_all(transport: str, refs: list[dict]) -> list:
    fetcher = EmbedsFetcher(RowRegion(transport, "127.0.0.1", HIDDEN, torch.float32, 4096))
    try:
        got = await asyncio.gather(*(fetcher.fetch(EmbedsRef.from_dict(r, f"p{i}"), f"p{i}")
                                     for i, r in enumerate(refs)), return_exceptions=True)
        assert fetcher.region.free_blocks == fetcher.region.num_blocks  # pulled or failed, no slot is kept
        return got
    finally:
        await fetcher.aclose()


def test_rows_pulled_through_the_transfer_engine_equal_the_files(encoder: tuple[WorkerProcess, Path]) -> None:
    worker, media = encoder
    paths = write_images(media, [3, 8, 1])
    reply = _encode(worker, [p.name for p in paths])
    assert reply.status_code == 200, reply.text
    refs = reply.json()["parts"]
    assert [r["shape"] for r in refs] == [[3, HIDDEN], [8, HIDDEN], [1, HIDDEN]]
    assert refs[1]["aux"] == {"image_size": [32, 33]} and refs[0]["dtype"] == "float32"
    assert _held(worker) == 3
    got = asyncio.run(_fetch_all(worker.transport, refs))
    for i, embeds in enumerate(got):
        assert torch.equal(embeds.tensor, rows([3, 8, 1][i], i)), i
        assert embeds.digest == refs[i]["digest"] == digest(rows([3, 8, 1][i], i))
    assert _held(worker) == 0  # pulled rows are freed at once
    again = asyncio.run(_fetch_all(worker.transport, refs[:1]))[0]
    assert isinstance(again, EmbedsTransferError) and "HTTP 404" in str(again)


def test_bad_parts_are_400s_naming_the_part_and_nothing_is_held(encoder: tuple[WorkerProcess, Path]) -> None:
    worker, media = encoder
    good = write_images(media, [2], first_seed=10)[0]
    torch.save(rows(2, 0, hidden=HIDDEN + 1), media / "wide.pt")
    torch.save(rows(2, 0).to(torch.float16), media / "half.pt")
    cases = {"wide.pt": "hidden size", "half.pt": "float32", "/etc/passwd": "outside", "missing.pt": "no such file"}
    for url, words in cases.items():
        reply = _encode(worker, [good.name, url])
        assert reply.status_code == 400, (url, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "messages[0].content[1]" and words in error["message"], (url, error)
    assert _held(worker) == 0  # the good part of a failed request is freed with it
    too_big = _encode(worker, [write_images(media, [2000], first_seed=20)[0].name])
    assert too_big.status_code == 503 and "no room" in too_big.json()["error"]["message"]
    assert _encode(worker, [good.name]).status_code == 200  # still serving


# tcp with --full: the TTL frees rows the same whatever moves them.
@pytest.mark.parametrize("encoder", ["shm", pytest.param("tcp", marks=pytest.mark.slow)], indirect=True)
def test_rows_nobody_pulls_are_freed_after_the_ttl(encoder: tuple[WorkerProcess, Path]) -> None:
    worker, media = encoder
    wait_until(lambda: _held(worker) == 0, timeout=10)  # what earlier tests left unpulled
    reply = _encode(worker, [p.name for p in write_images(media, [4, 4], first_seed=30)])
    assert reply.status_code == 200 and _held(worker) == 2
    wait_until(lambda: _held(worker) == 0, timeout=10)
    late = asyncio.run(_fetch_all(worker.transport, reply.json()["parts"][:1]))[0]
    assert isinstance(late, EmbedsTransferError) and "timed out" in str(late)


def test_a_cancelled_fetch_keeps_its_slot_until_the_encode_worker_has_answered(
        encoder: tuple[WorkerProcess, Path]) -> None:
    worker, media = encoder
    ref = EmbedsRef.from_dict(_encode(worker, [write_images(media, [64], first_seed=40)[0].name]).json()["parts"][0],
                              "p")

    async def run() -> None:
        fetcher = EmbedsFetcher(RowRegion(worker.transport, "127.0.0.1", HIDDEN, torch.float32, 4096))
        region = fetcher.region
        try:
            fetch = asyncio.ensure_future(fetcher.fetch(ref, "p"))
            await asyncio.sleep(0)   # one turn: the fetch has taken its slot and asked the encode worker
            fetch.cancel()           # as when the request's client leaves
            with pytest.raises(asyncio.CancelledError):
                await fetch
            assert region.free_blocks < region.num_blocks   # the push may still land there
            deadline = asyncio.get_running_loop().time() + 10
            while region.free_blocks != region.num_blocks:
                assert asyncio.get_running_loop().time() < deadline, "the slot was never freed"
                await asyncio.sleep(0.01)
        finally:
            await fetcher.aclose()

    asyncio.run(run())
    wait_until(lambda: _held(worker) == 0, timeout=10)   # pulled, or (rows earlier tests left) freed at the TTL
