"""examples/multiturn_chat.py: a chat over KV-aware routing, with and without the answers' KV written back."""
from __future__ import annotations

import re

import pytest

from tests.script_runs import listening, needs_di, run_script

TURN = re.compile(r"^=== turn (\d+): (\d+) prompt tokens; (prefill worker \d) computed (\d+) of them", re.M)


@needs_di
@pytest.mark.slow   # 11-22 s; the multiturn load's own tests (tests/benchmarks/test_bench_multiturn.py) run by default
@pytest.mark.parametrize("write_back", [True, False])
def test_each_turn_goes_where_the_chat_is_and_write_back_keeps_the_answers(write_back: bool) -> None:
    result = run_script("examples/multiturn_chat.py", "--turns", "3", "--max-tokens", "24",
                        *(() if write_back else ("--no-write-back",)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    turns = [(int(prompt), worker, int(computed)) for _, prompt, worker, computed in TURN.findall(result.stdout)]
    assert len(turns) == 3 and len({worker for _, worker, _ in turns}) == 1, turns   # one worker holds the chat
    assert turns[0][2] == turns[0][0]
    for (last_prompt, _, _), (prompt, _, computed) in zip(turns, turns[1:]):
        held = prompt - computed
        # The last turn's prompt is held either way; its answer only when written back.
        assert (held > last_prompt) if write_back else (last_prompt - 16 < held <= last_prompt), turns
    line = next(line for line in result.stdout.splitlines() if line.startswith("proxy http://"))
    assert not any(listening(int(port)) for port in re.findall(r"http://127\.0\.0\.1:(\d+)", line))


def test_bad_arguments_are_refused() -> None:
    result = run_script("examples/multiturn_chat.py", "--turns", "0")
    assert result.returncode == 2 and "--turns and --max-tokens must be at least 1" in result.stderr
