"""Errors of the scheduler.

    SchedulerError
    ├── QueueFull        the bounded waiting queue has no room
    └── WillNeverFit     the request needs more KV blocks than the whole pool holds
"""
from __future__ import annotations


class SchedulerError(Exception):
    """Base class of every error the scheduler raises."""


class QueueFull(SchedulerError):
    pass


class WillNeverFit(SchedulerError):
    pass
