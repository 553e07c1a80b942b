"""Scheduling decisions for the worker engine: pure logic, no tensors, no I/O."""
from __future__ import annotations

from scheduler.block_manager import Block, BlockManager
from scheduler.errors import QueueFull, SchedulerError, WillNeverFit
from scheduler.scheduler import ScheduledChunk, ScheduledStep, Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus, blocks_for

__all__ = [
    "Block", "BlockManager", "QueueFull", "ScheduledChunk", "ScheduledStep", "Scheduler", "SchedulerConfig", "SchedulerError",
    "Sequence", "SequenceStatus", "WillNeverFit", "blocks_for",
]
