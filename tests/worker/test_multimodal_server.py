"""Chat image parts through a real worker server (`python -m worker --allowed-local-media-path DIR
--max-file-size-mb 1`): outputs that depend on the images and only on them, and every kind of bad
part refused with a 400 naming it while the server keeps serving.

The worker serves a tiny random-weight checkpoint (its outputs vary with every input, unlike the
built-in model's on a chat prompt). The images are its own token embeddings of short texts, so a
prompt holding one must be answered exactly as the prompt holding its text."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
import torch

from stack.serving import free_port

from tests.helpers import wait_until
from tests.worker.multimodal_helpers import (SNIPPETS, MediaHTTPServer, data_url, image_part, pt_bytes, rows,
                                             safetensors_bytes, text_part, write, write_snippet_images)
from tests.worker_process import WorkerProcess

HIDDEN = 64    # the tiny checkpoint's hidden size (its dtype here: float32)
LIMIT = 2**20  # --max-file-size-mb 1


class Planted:
    """Unpickling this would create a file: a `.pt` holding it must be refused without running it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    write_snippet_images(allowed, tiny_llama)
    write(allowed / "aux.pt", pt_bytes({"embeddings": rows(5, HIDDEN, 10), "grid": [1, 5], "id": "x"}))
    write(root / "outside" / "secret.safetensors", safetensors_bytes(rows(4, HIDDEN, 99)))
    (allowed / "escape.safetensors").symlink_to(root / "outside" / "secret.safetensors")
    write(allowed / "big.safetensors", safetensors_bytes(rows(LIMIT // (HIDDEN * 4) + 8, HIDDEN, 0)))
    write(allowed / "wide.safetensors", safetensors_bytes(rows(4, 2 * HIDDEN, 0)))
    write(allowed / "half.safetensors", safetensors_bytes(rows(4, HIDDEN, 0, torch.float16)))
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        bad = rows(4, HIDDEN, 0)
        bad[2, 7] = value
        write(allowed / f"{name}.safetensors", safetensors_bytes(bad))
    write(allowed / "planted.pt", pt_bytes({"embeddings": rows(4, HIDDEN, 0), "x": Planted(root / "unpickled")}))
    return root


@pytest.fixture(scope="module")
def http_media(media: Path) -> Iterator[MediaHTTPServer]:
    files = {name: (media / "allowed" / name).read_bytes() for name in ("img4.safetensors", "big.safetensors")}
    server = MediaHTTPServer(files)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(media: Path, tiny_llama: Path) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(extra=["--model", str(tiny_llama), "--allowed-local-media-path", str(media / "allowed"),
                                "--max-file-size-mb", "1"])
    yield proc
    proc.stop()


def chat(worker: WorkerProcess, parts: list[dict], **sampling: object) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe:"}, *parts]}],
            "max_tokens": 12, "temperature": 0, **sampling}
    return httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60)


def urls(media: Path, http_media: MediaHTTPServer) -> list[str]:
    """img0..img5, each reached another way: relative path, absolute path, file://, data:, http://."""
    allowed = media / "allowed"
    return ["img0.safetensors", str(allowed / "img1.safetensors"), f"file://{allowed}/img2.safetensors",
            data_url((allowed / "img3.safetensors").read_bytes()), f"{http_media.url}/files/img4.safetensors",
            "img5.safetensors"]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_images_are_answered_as_their_text_and_only_they_decide(worker: WorkerProcess, media: Path,
                                                                http_media: MediaHTTPServer, n: int,
                                                                sampling: dict) -> None:
    every = urls(media, http_media)
    parts = [image_part(u) for u in every[:n]]
    first = chat(worker, parts, **sampling)
    assert first.status_code == 200, first.text
    as_text = chat(worker, [text_part(s) for s in SNIPPETS[:n]], **sampling).json()
    assert {k: first.json()[k] for k in ("choices", "usage")} == {k: as_text[k] for k in ("choices", "usage")}
    again = chat(worker, parts, **sampling)   # its blocks now come from the prefix cache
    assert again.json()["choices"] == first.json()["choices"]
    other = chat(worker, parts[:-1] + [image_part(every[5])], **sampling)   # the last image swapped for another
    assert other.json()["choices"] == chat(worker, [text_part(s) for s in SNIPPETS[:n - 1] + SNIPPETS[5:]],
                                           **sampling).json()["choices"]
    assert other.json()["choices"] != first.json()["choices"]
    assert chat(worker, parts, **sampling).json()["choices"] == first.json()["choices"]
    worker.wait_blocks_free()


def test_a_dict_with_aux_data_in_a_pt_file_is_accepted(worker: WorkerProcess) -> None:
    r = chat(worker, [image_part("aux.pt")], temperature=0)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12


BAD_PARTS: list[tuple[str, Callable[[Path, MediaHTTPServer], str], str]] = [
    ("dotdot", lambda m, h: "../outside/secret.safetensors", "'..' is not allowed in a local path"),
    ("absolute-outside", lambda m, h: str(m / "outside" / "secret.safetensors"),
     "is outside the allowed local media directory"),
    ("file-url-outside", lambda m, h: f"file://{m}/outside/secret.safetensors",
     "is outside the allowed local media directory"),
    ("symlink-escape", lambda m, h: "escape.safetensors", "is outside the allowed local media directory"),
    ("missing", lambda m, h: "missing.safetensors", "no such file: missing.safetensors"),
    ("file-over-limit", lambda m, h: "big.safetensors", "big.safetensors is larger than the limit of 1 MB"),
    ("download-over-limit", lambda m, h: f"{h.url}/files/big.safetensors", "is larger than the limit of 1 MB"),
    ("data-url-over-limit", lambda m, h: data_url((m / "allowed" / "big.safetensors").read_bytes()),
     "the data: url is larger than the limit of 1 MB"),
    ("wrong-hidden-size", lambda m, h: "wide.safetensors",
     f"the embeddings must have shape [n >= 1, {HIDDEN}] (the model's hidden size), got [4, {2 * HIDDEN}]"),
    ("wrong-dtype", lambda m, h: "half.safetensors",
     "the embeddings must be float32 (the model's dtype), got float16"),
    ("nan", lambda m, h: "nan.safetensors", "the embeddings contain NaN or infinite values"),
    ("inf", lambda m, h: "inf.safetensors", "the embeddings contain NaN or infinite values"),
    ("pickled-object", lambda m, h: "planted.pt", "not a safetensors or torch tensor file"),
    ("unreachable-url", lambda m, h: f"http://127.0.0.1:{free_port()}/x.safetensors", "cannot fetch"),
    ("unsupported-scheme", lambda m, h: "ftp://127.0.0.1/x.pt", "unsupported url scheme 'ftp'"),
]


@pytest.mark.parametrize("url, message", [case[1:] for case in BAD_PARTS], ids=[case[0] for case in BAD_PARTS])
def test_a_bad_part_is_400_naming_it_and_the_server_keeps_serving(
        worker: WorkerProcess, media: Path, http_media: MediaHTTPServer,
        url: Callable[[Path, MediaHTTPServer], str], message: str) -> None:
    param = "messages[0].content[2]"   # the part after a good image
    r = chat(worker, [image_part("img0.safetensors"), image_part(url(media, http_media))])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and message in error["message"], error["message"]
    assert not (media / "unpickled").exists()
    assert chat(worker, [image_part("img0.safetensors")]).status_code == 200
    worker.wait_blocks_free()


def test_an_endless_download_is_cut_at_the_limit(worker: WorkerProcess, http_media: MediaHTTPServer) -> None:
    r = chat(worker, [image_part(f"{http_media.url}/endless")])
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    assert "is larger than the limit of 1 MB" in r.json()["error"]["message"]
    wait_until(http_media.cut.is_set, timeout=30, what="the worker to close the endless download")
    # It read a little past the limit; the rest of what was sent sat in socket buffers.
    assert http_media.endless_bytes_sent < 64 * LIMIT
    assert chat(worker, [image_part("img0.safetensors")]).status_code == 200
    worker.wait_blocks_free()


def test_text_holding_the_image_marker_is_refused(worker: WorkerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "a <|neuron_di_image|> b"}], "max_tokens": 2}
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
