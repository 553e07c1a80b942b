"""Completion tokens: the caller's handle on one queued transfer."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from transfer.errors import TransferError, TransferTimeout

log = logging.getLogger(__name__)

_PENDING, _RUNNING, _FINISHED = "pending", "running", "finished"


class CompletionToken:
    """Reports whether a queued transfer is done, and its error if it failed.

    A token moves pending -> running -> finished. A token still pending at its deadline
    expires with TransferTimeout and is never started, so a late start cannot write into
    blocks the caller has already given up on; a running transfer enforces the same
    deadline itself (socket timeouts, bounded polling).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._state = _PENDING
        self._error: TransferError | None = None
        self._checksum: int | None = None
        self._deadline: float | None = None
        self._callbacks: list[Callable[[CompletionToken], None]] = []

    # -- caller side ------------------------------------------------------------------
    def is_done(self) -> bool:
        """True once the transfer finished, successfully or not."""
        self._expire_if_overdue()
        return self._event.is_set()

    @property
    def error(self) -> TransferError | None:
        """The typed error of a failed transfer, None while pending or after success."""
        self._expire_if_overdue()
        return self._error

    @property
    def checksum(self) -> int | None:
        """The CRC-32C of the bytes a summed transfer sent (transfer.checksum), once it succeeded."""
        return self._checksum

    def add_done_callback(self, callback: Callable[[CompletionToken], None]) -> None:
        """Calls `callback(token)` once the transfer finishes, from the thread that finishes it
        (at once if it already has), so a waiter can sleep instead of polling `is_done`. A token
        that expires while queued reports it when next looked at (`is_done`, `wait`, or its start)."""
        with self._lock:
            if self._state != _FINISHED:
                self._callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the transfer finishes; raises its error if it failed.

        Raises TransferTimeout if it is still running after `timeout` seconds (the token
        itself stays valid and may still complete).
        """
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_done():
            now = time.monotonic()
            if end is not None and now >= end:
                raise TransferTimeout(f"transfer not done after waiting {timeout}s")
            limits = [t - now for t in (end, self._deadline) if t is not None]
            self._event.wait(max(0.0, min(limits)) + 0.001 if limits else None)
        if self._error is not None:
            raise self._error

    # -- engine side ------------------------------------------------------------------
    def _arm(self, deadline: float) -> None:
        with self._lock:
            if self._deadline is not None or self._state != _PENDING:
                raise ValueError("a CompletionToken can be used for one transfer only")
            self._deadline = deadline

    def _start(self) -> bool:
        """Claims the token for running; False if it already expired or finished."""
        self._expire_if_overdue()
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _RUNNING
            return True

    def _finish(self, error: TransferError | None = None, checksum: int | None = None) -> None:
        with self._lock:
            if self._state == _FINISHED:
                return
            self._state, self._error, self._checksum = _FINISHED, error, checksum
        self._done()

    def _expire_if_overdue(self) -> None:
        with self._lock:
            if self._state != _PENDING or self._deadline is None or time.monotonic() < self._deadline:
                return
            self._state = _FINISHED
            self._error = TransferTimeout("transfer still queued at its deadline")
        self._done()

    def _done(self) -> None:
        self._event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - a waiter's callback must not kill the transfer thread
                log.exception("a completion callback of %r raised", self)

    def __repr__(self) -> str:
        return f"<CompletionToken {self._state} error={self._error!r}>"
