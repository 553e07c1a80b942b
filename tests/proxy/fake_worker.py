"""A fake prefill/decode worker: a real HTTP server (aiohttp) that behaves like the worker roles.

It "generates" deterministic word tokens from the prompt, one SSE chunk per token, in the
OpenAI formats a vLLM-style server uses. With `kv_transfer_params.role == "prefill"` it
answers like a prefill worker; with role "decode" it repeats the first token and goes on;
without it, it is an ordinary single server, whose output the stitched output must equal.
Like vLLM's NixlConnector, `kv_transfer_params.do_remote_decode` makes it a prefill leg that
answers with `nixl_handoff(uid, kv_port)` as its `kv_transfer_params`, and
`do_remote_prefill` a decode leg. Each leg's whole body is recorded.

A request may steer it with a body field `fake` (the proxy passes unknown fields on):
`{"eos_at": k}` ends the answer with an EOS token at token k, and per leg role
(`"prefill"`, `"decode"`, `"single"`): `{"status": 500}`, `{"hang": true}`,
`{"delay": seconds_per_token}`, `{"die_after": n}` (os._exit after n chunks),
`{"first_token": text}` (a different first token), `{"no_handoff": true}` (a NixlConnector
prefill answer without `kv_transfer_params`), `{"pull_error": message}` (a vLLM decode worker whose
KV pull failed, which its connector's status server shows at GET /timeline: with a status, it
answers that; streamed without one, it ends its 200 stream with vLLM's error event);
`{"by_prompt": {PROMPT: {...}}}` steers the legs of one prompt (a string) otherwise. Started with
`--draining`, it refuses every leg (recorded all the same) as a draining worker does: 503 worker_draining.

    python -m tests.proxy.fake_worker --role decode --port 8200 [--etcd HOST:PORT --lease-ttl 2] [--draining]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import zlib
from typing import Any

from aiohttp import web

from tests.proxy.registration import register_forever


DRAINING = {"error": {"message": "this worker is draining and takes no new requests; send the request to another "
                                 "worker", "type": "worker_draining", "param": None, "code": 503}}


class FakeWorker:
    """Request handlers plus what the tests inspect at GET /fake/state."""

    def __init__(self, role: str, model: str, kv_port: int, draining: bool = False) -> None:
        self.role = role
        self.draining = draining
        self.model = model
        self.kv_port = kv_port
        self.active = 0
        self.legs: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.pull_errors: dict[str, str] = {}   # uid -> why its pull failed (GET /timeline shows it)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                web.get("/health", self.health), web.get("/v1/models", self.models),
                web.get("/fake/state", self.state), web.get("/timeline", self.timeline)]

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def timeline(self, request: web.Request) -> web.Response:
        uid = request.query.get("uid", "")
        records = [{"uid": uid, "source": self.role, "phases": {}, "tokens": [], "error": self.pull_errors[uid]}
                   ] if uid in self.pull_errors else []
        return web.json_response({"source": self.role, "requests": records})

    async def models(self, _: web.Request) -> web.Response:
        models = [{"id": self.model, "object": "model", "owned_by": "fake"}]
        return web.json_response({"object": "list", "data": models})

    async def state(self, _: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "active": self.active, "legs": self.legs,
                                  "cancelled": self.cancelled})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        leg = kv.get("role") or _nixl_leg(kv)
        uid = request.headers.get("X-Request-Id", "")
        self.legs.append({"uid": uid, "leg": leg, "kv_transfer_params": kv, "max_tokens": body.get("max_tokens"),
                          "stream": bool(body.get("stream")), "user": body.get("user"), "body": body})
        fake = body.get("fake") or {}
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            fake = {**fake, **(fake.get("by_prompt") or {}).get(prompt, {})}
        steer = fake.get(leg, {})
        if self.draining:
            return web.json_response(DRAINING, status=503, headers={"Retry-After": "1"})
        self.active += 1
        try:
            if "pull_error" in steer:
                self.pull_errors[uid] = steer["pull_error"]
            if "status" in steer:
                return web.json_response({"error": {"message": "fake failure", "type": "fake", "param": None,
                                                    "code": steer["status"]}}, status=steer["status"])
            if steer.get("hang"):
                await asyncio.sleep(3600)
            answer = _Answer(body, chat, self.model, uid, steer.get("first_token"))
            if body.get("stream"):
                return await self._stream(request, answer, steer)
            await asyncio.sleep(steer.get("delay", 0) * len(answer.tokens))
            whole = answer.whole()
            if kv.get("do_remote_decode") and not steer.get("no_handoff"):
                whole["kv_transfer_params"] = nixl_handoff(uid, self.kv_port)
            return web.json_response(whole)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(uid)  # the proxy went away: the leg is over
            raise
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, answer: _Answer, steer: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if "pull_error" in steer:
            error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
            await response.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response
        for sent, chunk in enumerate(answer.chunks()):
            if sent == steer.get("die_after"):
                os._exit(1)
            if steer.get("delay") and sent:
                await asyncio.sleep(steer["delay"])
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _nixl_leg(kv: dict[str, Any]) -> str:
    return "prefill" if kv.get("do_remote_decode") else "decode" if kv.get("do_remote_prefill") else "single"


def nixl_handoff(uid: str, kv_port: int) -> dict[str, Any]:
    """What a NixlConnector prefill answers with: where decode finds this request's KV blocks."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "fake-prefill-engine",
            "remote_block_ids": [zlib.crc32(uid.encode()) % 1000, 7], "remote_host": "127.0.0.1",
            "remote_port": kv_port, "tp_size": 1}


class _Answer:
    """The deterministic answer to one request, whole or as chunks."""

    def __init__(self, body: dict[str, Any], chat: bool, model: str, uid: str, first_token: str | None) -> None:
        self.chat = chat
        text = (" ".join(str(m.get("content", "")) for m in body["messages"]) if chat else
                body["prompt"] if isinstance(body["prompt"], str) else json.dumps(body["prompt"]))
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        eos_at = (body.get("fake") or {}).get("eos_at")
        seed = zlib.crc32(text.encode())
        count = min(limit, eos_at) if eos_at else limit
        # EOS decodes to no text; it ends the answer with "stop" instead of "length".
        self.tokens = ["" if eos_at == i + 1 else f" w{(seed + 7 * i) % 1000}" for i in range(count)]
        if first_token is not None:
            self.tokens[0] = first_token
        self.finish = "stop" if eos_at and eos_at <= limit else "length"
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + (uid or "local"), "created": int(time.time()),
                     "model": model}
        self.options = body.get("stream_options") or {}
        prompt = len(text.split())
        self.usage = {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text})
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [{**choice, "logprobs": None, "finish_reason": self.finish}], "usage": self.usage}

    def chunks(self) -> list[dict[str, Any]]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = []
        if self.chat:
            out.append({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        for i, token in enumerate(self.tokens):
            body = {"delta": {"content": token}} if self.chat else {"text": token}
            last = i == len(self.tokens) - 1
            out.append({"index": 0, **body, "logprobs": None, "finish_reason": self.finish if last else None})
        chunks = [{**self.head, "object": obj, "choices": [choice]} for choice in out]
        if self.options.get("include_usage"):
            chunks.append({**self.head, "object": obj, "choices": [], "usage": self.usage})
        return chunks


async def serve(role: str, port: int, model: str, etcd: str | None, kv_port: int, lease_ttl: int,
                draining: bool = False) -> None:
    app = web.Application()
    app.add_routes(FakeWorker(role, model, kv_port, draining).routes())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    if etcd:
        await register_forever(etcd, role, "127.0.0.1", port, kv_port, model, lease_ttl)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("prefill", "decode", "both"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--etcd")
    parser.add_argument("--kv-port", type=int, default=14579)
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument("--draining", action="store_true", help="refuse every leg as a draining worker does")
    args = parser.parse_args()
    asyncio.run(serve(args.role, args.port, args.model, args.etcd, args.kv_port, args.lease_ttl, args.draining))


if __name__ == "__main__":
    main()
