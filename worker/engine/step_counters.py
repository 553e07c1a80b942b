"""What the engine's steps computed and how long they took: the live figures a planner sizes a fleet by.

A step that only prefills tells how fast this worker prefills (prompt tokens per second); one that only
decodes tells its step time at its batch. Steps that do both count as busy time only.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler import ScheduledStep


def step_shape(step: ScheduledStep) -> tuple[int, int]:
    """(prompt tokens, decodes) of a step: its tokens at prompt positions, and its sequences past their prompt."""
    prompt_tokens = sum(max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start) for c in step.chunks)
    return prompt_tokens, sum(c.start >= c.seq.num_prompt_tokens for c in step.chunks)


@dataclass(slots=True)
class StepCounters:
    """Running totals since the worker started (they survive a change of role)."""

    busy_seconds: float = 0.0
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_seqs: int = 0           # the decode steps' batch sizes, summed

    def count(self, step: ScheduledStep, seconds: float) -> None:
        prompt_tokens, decodes = step_shape(step)
        self.busy_seconds += seconds
        if prompt_tokens and not decodes:
            self.prefill_steps += 1
            self.prefill_seconds += seconds
            self.prefill_tokens += prompt_tokens
        elif decodes and not prompt_tokens:
            self.decode_steps += 1
            self.decode_seconds += seconds
            self.decode_seqs += decodes
