"""Errors of the embeddings transfer; each is also the worker error whose HTTP status it should get.

    EmbedsError                  (worker.errors.WorkerError)
    ├── RegionFull               (also QueueFullError: 503) no free rows for the embeddings right now
    ├── UnknownHandle            (404) the rows were pulled already, timed out, or never existed
    └── EmbedsTransferError      (also KVTransferError: 500 kv_transfer_error, whose message the proxy
                                 passes on in its 502) the rows could not be pulled from the encode worker
"""
from __future__ import annotations

from worker.errors import KVTransferError, QueueFullError, WorkerError


class EmbedsError(WorkerError):
    """Base class of the embeddings transfer's errors."""


class RegionFull(EmbedsError, QueueFullError):
    pass


class UnknownHandle(EmbedsError):
    pass


class EmbedsTransferError(EmbedsError, KVTransferError):
    def __init__(self, message: str) -> None:
        KVTransferError.__init__(self, message, retryable=False)
