"""Errors of the embeddings transfer.

    EmbedsError                  (worker.errors.WorkerError)
    ├── RegionFull               no free rows for the embeddings right now (503; retry later)
    ├── UnknownHandle            the rows were pulled already, timed out, or never existed (404)
    └── EmbedsTransferError      the rows could not be pulled from the encode worker (502)
"""
from __future__ import annotations

from worker.errors import WorkerError


class EmbedsError(WorkerError):
    """Base class of the embeddings transfer's errors."""


class RegionFull(EmbedsError):
    pass


class UnknownHandle(EmbedsError):
    pass


class EmbedsTransferError(EmbedsError):
    pass
