"""The request flows of a disaggregated request: how its prefill and decode legs are started.

`--disaggregation-strategy` picks the flow for kv_protocol "neuron" workers (our signal plane):

    concurrent     both legs at once; decode's pull waits (lookup_all retries) until prefill has the KV
    prefill_first  prefill answers first, with where its KV blocks are; only then does decode start,
                   and its first lookup_all finds them; EOS at token one: decode is not called
    decode_first   one leg, to decode, naming the prefill worker: decode asks it for the prompt's KV
                   itself and streams every token, the first included

kv_protocol "nixl" (vLLM's NixlConnector) always goes prefill first, with vLLM's own handoff,
whatever the strategy. Each flow gets the leg client (proxy/leg_client.py) and returns prefill's
answer and the decode leg: `concurrent` and `prefill_first` a prefill answer that the forwarder
stitches with the decode leg; `decode_first` no prefill answer, and the decode leg is relayed whole.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from common.handoff import KV_TRANSFER_PARAMS, HandoffError, PrefillHandoff, nixl_prefill_params
from proxy.errors import UpstreamProtocol
from proxy.requests import (ClientRequest, decode_body, neuron_decode_leg, neuron_decode_params, neuron_prefill_params,
                            prefill_body, prefill_token_used)
from proxy.stitch import prefill_finished
from proxy.workers import WorkerRecord

if TYPE_CHECKING:
    from proxy.leg_client import LegClient, Took

STRATEGIES = ("concurrent", "prefill_first", "decode_first")
DEFAULT_STRATEGY = "concurrent"
_WILDCARD_HOSTS = ("0.0.0.0", "::")


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """A started decode leg; a streamed one delivers its SSE payloads through `queue`."""

    worker: WorkerRecord
    task: asyncio.Task[Any]
    queue: asyncio.Queue[Any] | None = None


# Prefill's answer (None: decode's leg is the whole answer), and the decode leg (None: not called).
Handoff = tuple[dict[str, Any] | None, DecodeLeg | None]
Flow = Callable[["LegClient", ClientRequest, WorkerRecord, WorkerRecord, str, int | None, "Took | None"],
                Awaitable[Handoff]]


def flow_for(strategy: str, prefill: WorkerRecord) -> Flow:
    """The flow of a request to `prefill`."""
    if prefill.kv_protocol == "nixl":
        return prefill_first  # vLLM's own handoff, whatever the strategy
    return {"decode_first": decode_first, "prefill_first": prefill_first}.get(strategy, concurrent)


async def concurrent(legs: LegClient, request: ClientRequest, prefill: WorkerRecord, decode: WorkerRecord,
                     uid: str, seed: int | None, took: Took | None = None) -> Handoff:
    """Both legs at once; decode pulls the KV blocks when prefill has them."""
    headers = {"X-Request-Id": uid}
    pbody = prefill_body(request, seed, neuron_prefill_params(uid, decode), prefill_token_used(prefill, seed))
    dbody = decode_body(request, seed, neuron_decode_params(uid, prefill))
    prefill_task = spawn(legs.call(prefill, request.endpoint.path, pbody, headers))
    leg = legs.start_decode(decode, request, dbody, headers, took)
    try:
        return json_object(await first_or_failure(prefill_task, leg.task), prefill), leg
    except BaseException:
        leg.task.cancel()  # a failed leg has cancelled both already; prefill's answer may not be JSON
        raise


async def prefill_first(legs: LegClient, request: ClientRequest, prefill: WorkerRecord, decode: WorkerRecord,
                        uid: str, seed: int | None, took: Took | None = None) -> Handoff:
    """Prefill answers with where its KV lies; then decode starts with that (EOS at token one: never)."""
    headers = {"X-Request-Id": uid}
    nixl = prefill.kv_protocol == "nixl"
    # Our prefill worker frees at once the blocks of an answer its token ended: no decode leg will pull them.
    # It is not told which decode engine will pull: the decode leg goes out only once prefill answered, and a
    # worker that changed role meanwhile sends it on to another (the first lookup names the puller), whereas
    # the one named would have its blocks released once its session went.
    params = nixl_prefill_params() if nixl else neuron_prefill_params(uid, pulled_on_stop=False)
    pbody = prefill_body(request, seed, params, nixl or prefill_token_used(prefill, seed))
    first = json_object(await legs.call(prefill, request.endpoint.path, pbody, headers), prefill)
    if prefill_finished(first):
        return first, None
    handoff = nixl_handoff(first, prefill) if nixl else neuron_handoff(first, uid, prefill)
    return first, legs.start_decode(decode, request, decode_body(request, seed, handoff), headers, took)


async def decode_first(legs: LegClient, request: ClientRequest, prefill: WorkerRecord, decode: WorkerRecord,
                       uid: str, seed: int | None, took: Took | None = None) -> Handoff:
    """One leg, to decode, naming `prefill`: decode asks it for the prompt's KV itself and answers whole."""
    body = decode_first_body(request, uid, seed, prefill)
    return None, legs.start_decode(decode, request, body, {"X-Request-Id": uid}, took)


def decode_first_body(request: ClientRequest, uid: str, seed: int | None, prefill: WorkerRecord) -> dict[str, Any]:
    """The one leg of decode_first: the client's body, naming the prefill worker decode asks for the KV
    (`remote_url` its HTTP API, the rest its signal plane, as a concurrent decode leg names it)."""
    leg = dataclasses.replace(neuron_decode_leg(uid, prefill), remote_url=prefill.base_url)
    return decode_body(request, seed, leg.to_dict())


def neuron_handoff(first: dict[str, Any], uid: str, prefill: WorkerRecord) -> dict[str, Any]:
    """Decode's kv_transfer_params after a neuron prefill answered: where its answer says its blocks are
    (a worker bound to every address is reached at the host the proxy knows); what the answer does not
    say (a `vllm serve` with NeuronConnector says nothing) comes from the prefill worker's record."""
    leg = neuron_decode_leg(uid, prefill)
    if not isinstance(first.get(KV_TRANSFER_PARAMS), dict):
        return leg.to_dict()
    try:
        shown = PrefillHandoff.parse(first[KV_TRANSFER_PARAMS])
    except HandoffError as exc:
        raise UpstreamProtocol(f"answer's {exc}", prefill.role, prefill.address) from exc
    if shown.request_id not in (None, uid):
        raise UpstreamProtocol(f"answer's kv_transfer_params name request {shown.request_id!r}, "
                               f"not {uid!r}", prefill.role, prefill.address)
    host = shown.host if shown.host and shown.host not in _WILDCARD_HOSTS else leg.host
    return dataclasses.replace(leg, host=host, port=shown.port or leg.port,
                               engine_id=shown.engine_id or leg.engine_id).to_dict()


def nixl_handoff(first: dict[str, Any], prefill: WorkerRecord) -> dict[str, Any]:
    """The kv_transfer_params in a NixlConnector prefill's answer: what decode needs to pull the KV."""
    params = first.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict):
        raise UpstreamProtocol("answer has no kv_transfer_params object for decode (is it a vLLM worker with "
                               "NixlConnector?)", prefill.role, prefill.address)
    return params


async def first_or_failure(main: asyncio.Future[Any], other: asyncio.Task[Any]) -> Any:
    """The result of `main`; if `other` fails first (or we are cancelled), cancels both and raises."""
    try:
        while not main.done():
            await asyncio.wait({main} if other.done() else {main, other}, return_when=asyncio.FIRST_COMPLETED)
            if other.done() and not other.cancelled() and other.exception() is not None:
                raise other.exception()  # type: ignore[misc]
        return main.result()
    except BaseException:
        main.cancel()
        other.cancel()
        raise


def spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(coro)
    # A leg cancelled after the other failed may fail too; that error is already reported.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def json_object(body: bytes, worker: WorkerRecord) -> dict[str, Any]:
    """A worker's JSON object answer; UpstreamProtocol naming the worker if it is not one."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise UpstreamProtocol(f"answer is not JSON: {body[:80]!r}", worker.role, worker.address) from exc
    if not isinstance(data, dict):
        raise UpstreamProtocol("answer is not a JSON object", worker.role, worker.address)
    return data
