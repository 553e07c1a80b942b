"""The checks every fault scenario's result must pass."""
from __future__ import annotations

from faults.judge import ScenarioResult


def assert_clean(result: ScenarioResult) -> None:
    """No call hung, every failure was a clear error, every success was the reference output,
    the stack served again after a restart, and no live worker holds a KV block."""
    t = result.tally
    assert t.sent > 0
    assert (t.hung, t.wrong, t.unclear) == (0, 0, 0), t.problems
    assert t.ok + t.clear_error == t.sent
    assert result.recovered is not False, t.problems
    assert not any(result.blocks_leaked.values()), result.blocks_leaked
