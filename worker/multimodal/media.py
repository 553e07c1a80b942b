"""Loading an image part's url into a tensor, safely: local files only under one allowed directory,
and nothing (file, data: url or download) bigger than the size limit is ever read whole.

    a path or file:// url   only with `allowed_dir`; resolved (symlinks followed) and refused unless it
                            stays inside it; a relative path is taken relative to it
    data:[...][;base64],..  the bytes inline
    http:// or https://     streamed; the connection is dropped as soon as the limit is passed
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlparse

import httpx
import torch

from worker.errors import invalid
from worker.multimodal.tensor_file import decode_tensor_file

DOWNLOAD_TIMEOUT_S = 30.0    # connect, and each read: a stalled server is an error, not a hang
DOWNLOAD_DEADLINE_S = 120.0  # the whole download: a server dripping bytes cannot hold a request for longer
_SHOWN_URL_CHARS = 120


@dataclass(frozen=True)
class MediaPolicy:
    """Where image parts may be read from: `allowed_dir` None means no local file at all."""

    allowed_dir: Path | None = None
    max_file_size_mb: float = 50

    def __post_init__(self) -> None:
        if not self.max_file_size_mb > 0:
            raise ValueError(f"max_file_size_mb must be positive, got {self.max_file_size_mb!r}")

    @property
    def max_bytes(self) -> int:
        return int(self.max_file_size_mb * 2**20)


def download_client() -> httpx.AsyncClient:
    """The client load_part downloads with (keep one for the life of a server)."""
    return httpx.AsyncClient(timeout=DOWNLOAD_TIMEOUT_S, follow_redirects=False)


async def load_part(url: str, policy: MediaPolicy, part: str,
                    client: httpx.AsyncClient | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The tensor and auxiliary data `url` holds; InvalidRequestError naming `part` for anything wrong.

    `client` downloads http(s) urls (default: a client for this call only).
    """
    if not isinstance(url, str) or not url:
        raise invalid(f"{part}: the url must be a non-empty string", part)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        if client is None:
            async with download_client() as own:
                data = await _download(url, policy.max_bytes, part, own)
        else:
            data = await _download(url, policy.max_bytes, part, client)
    elif scheme == "data":
        data = _data_url(url, policy.max_bytes, part)
    elif scheme in ("", "file"):
        data = await asyncio.to_thread(_read_file, _local_path(url, policy, part), policy.max_bytes, part)
    else:
        raise invalid(f"{part}: unsupported url scheme {scheme!r} (use a file path, file://, data: or http(s)://)",
                      part)
    return await asyncio.to_thread(decode_tensor_file, data, part)


def _local_path(url: str, policy: MediaPolicy, part: str) -> Path:
    if policy.allowed_dir is None:
        raise invalid(f"{part}: local files are not allowed (the worker has no --allowed-local-media-path)", part)
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise invalid(f"{part}: file:// urls must name a local file, got host {parsed.netloc!r}", part)
    raw = Path(unquote(parsed.path) if parsed.scheme == "file" else url)
    if ".." in raw.parts:
        raise invalid(f"{part}: '..' is not allowed in a local path", part)
    root = policy.allowed_dir.resolve()
    path = (root / raw).resolve()   # an absolute `raw` replaces root; symlinks are followed
    if not path.is_relative_to(root):
        raise invalid(f"{part}: {_shown(url)} is outside the allowed local media directory", part)
    return path


def _read_file(path: Path, limit: int, part: str) -> bytes:
    try:
        # O_NOFOLLOW: a symlink put in place after the path was resolved is not followed;
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused below).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as exc:
        raise invalid(f"{part}: no such file: {path.name}", part) from exc
    except OSError as exc:
        raise invalid(f"{part}: cannot open {path.name}: {exc.strerror}", part) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise invalid(f"{part}: {path.name} is not a regular file", part)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise invalid(f"{part}: {path.name} is larger than the limit of {_mb(limit)}", part)
    return data


def _data_url(url: str, limit: int, part: str) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise invalid(f"{part}: malformed data: url (no ',')", part)
    if header.endswith(";base64"):
        if len(payload) // 4 * 3 > limit + 3:
            raise invalid(f"{part}: the data: url is larger than the limit of {_mb(limit)}", part)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise invalid(f"{part}: the data: url is not valid base64", part) from exc
    else:
        data = unquote_to_bytes(payload)
    if len(data) > limit:
        raise invalid(f"{part}: the data: url is larger than the limit of {_mb(limit)}", part)
    return data


async def _download(url: str, limit: int, part: str, client: httpx.AsyncClient) -> bytes:
    try:
        return await asyncio.wait_for(_stream(url, limit, part, client), DOWNLOAD_DEADLINE_S)
    except asyncio.TimeoutError as exc:
        raise invalid(f"{part}: downloading {_shown(url)} took longer than {DOWNLOAD_DEADLINE_S:g} s", part) from exc


async def _stream(url: str, limit: int, part: str, client: httpx.AsyncClient) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        # identity: the limit counts the bytes that arrive, never what they would inflate to.
        async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
            if response.status_code != 200:
                raise invalid(f"{part}: GET {_shown(url)} answered {response.status_code}", part)
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > limit:
                raise invalid(f"{part}: {_shown(url)} is larger than the limit of {_mb(limit)}", part)
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > limit:   # leaving the block closes the connection: nothing more is read
                    raise invalid(f"{part}: {_shown(url)} is larger than the limit of {_mb(limit)}", part)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise invalid(f"{part}: cannot fetch {_shown(url)}: {type(exc).__name__}: {exc}", part) from exc
    return b"".join(chunks)


def _shown(url: str) -> str:
    return url if len(url) <= _SHOWN_URL_CHARS else url[:_SHOWN_URL_CHARS] + "..."


def _mb(limit: int) -> str:
    return f"{limit / 2**20:g} MB"
