"""What tests ask of a scheduled step."""
from __future__ import annotations

from scheduler import ScheduledStep


def prefills(step: ScheduledStep) -> bool:
    """Whether the step computes prompt tokens (a new request's, or a preempted one's again)."""
    return any(c.start < c.seq.num_prompt_tokens for c in step.chunks)
