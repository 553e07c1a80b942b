"""Test helpers for image parts: embeddings tensors and the files and urls that hold them."""
from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from worker.model.loader import load_config
from common.tokenizer import Tokenizer
from worker.multimodal.embeds import ImageEmbeds, image_embeds

# img0 .. img5 of write_snippet_images: a checkpoint's own input embeddings of these texts, so a prompt
# holding image i must be answered exactly as the prompt holding SNIPPETS[i] as text.
SNIPPETS = [" cat", " the sea", " a red car", "def add(a, b):", " hello", " print(x)"]


def rows(n: int, hidden: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n seeded rows on the scale of the test models' token embeddings."""
    return (torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype)


def embeds(n: int, hidden: int, seed: int) -> ImageEmbeds:
    return image_embeds(rows(n, hidden, seed), {}, hidden, torch.float32, "test")


def safetensors_bytes(tensor: torch.Tensor, **others: torch.Tensor) -> bytes:
    return save_safetensors({"embeddings": tensor, **others} if others else {"embeddings": tensor})


def pt_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def data_url(data: bytes) -> str:
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def write_snippet_images(directory: Path, checkpoint: Path) -> None:
    """directory/img{i}.safetensors: `checkpoint`'s token embeddings of SNIPPETS[i]."""
    tokenizer = Tokenizer.from_dir(checkpoint, load_config(checkpoint))
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight").float()
    for i, text in enumerate(SNIPPETS):
        write(directory / f"img{i}.safetensors", safetensors_bytes(table[tokenizer.encode(text, add_bos=False)]))


class MediaHTTPServer:
    """An HTTP server on 127.0.0.1 (a thread of the test): GET /files/NAME answers `files[NAME]`,
    GET /endless a body that never ends, until the client closes the connection (`cut` is then set)."""

    CHUNK = 64 * 1024
    GIVE_UP_BYTES = 2**30   # a client that never stops reading fails the test instead of hanging it

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.cut = threading.Event()
        self.endless_bytes_sent = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/endless":
                    server._endless(self)
                elif self.path.removeprefix("/files/") in server.files:
                    data = server.files[self.path.removeprefix("/files/")]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self.send_error(404)

        return Handler

    def _endless(self, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)   # no Content-Length: the body lasts until the connection closes
        handler.end_headers()
        chunk = b"\0" * self.CHUNK
        try:
            while self.endless_bytes_sent < self.GIVE_UP_BYTES:
                handler.wfile.write(chunk)
                self.endless_bytes_sent += len(chunk)
        except OSError:   # BrokenPipe / ConnectionReset: the client stopped reading and closed
            self.cut.set()
        handler.close_connection = True

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
