"""The engine's one table of live requests: the answer to "is this id in use"."""
from __future__ import annotations

from typing import Iterator

from worker.engine.request import Request, RequestOutput


class RequestTable:
    """Every live request of one engine, by id, from `add` until nothing refers to it.

    A request is live while it generates, and after that for as long as its KV blocks are
    held for a transfer: a prefill leg's blocks until its decode peer pulled them, a decode
    leg aborted mid-pull until the peer can no longer write into its blocks. The outputs of
    aborted requests wait here until the next step reports them.
    """

    def __init__(self) -> None:
        self._live: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._live.values()))

    def add(self, request: Request) -> None:
        assert request.request_id not in self._live, f"{request.request_id} is already live"
        self._live[request.request_id] = request

    def get(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    def generating(self, request_id: str) -> Request | None:
        """The request if it still has outputs to come (not done, not aborted)."""
        request = self._live.get(request_id)
        return None if request is None or request.finished_generating else request

    def remove(self, request_id: str) -> Request:
        return self._live.pop(request_id)

    def aborted(self, request: Request) -> None:
        """Records the one output an aborted request still owes its caller."""
        self._aborted.append(RequestOutput(request.request_id, [], "", True, "abort", request.num_prompt_tokens,
                                           request.num_output_tokens))

    def take_aborted(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        return outputs

    def has_work(self) -> bool:
        """Anything live, or an abort not reported yet."""
        return bool(self._live or self._aborted)

    def has_unreported_aborts(self) -> bool:
        return bool(self._aborted)
