"""examples/demo_1p1d.py, the README's main job: a real 1P1D stack answers through the openai client."""
from __future__ import annotations

import pytest

from examples.demo_1p1d import PROMPTS
from tests.script_runs import interrupted_run, listening, needs_di, run_script, stack_ports
from worker.model.loader import BUILTIN_MODEL_NOTE


@needs_di
def test_demo_answers_every_request_and_stops_the_stack():
    result = run_script("examples/demo_1p1d.py", "--max-tokens", "6", "--kv-transport", "tcp")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.count("=== completion (") == 2 and out.count("+ 6 completion tokens)") == 2
    for title in ("=== streamed completion", "=== chat: 'def add(a, b):'", "=== streamed chat: 'def add(a, b):'"):
        assert title in out
    assert out.rstrip().endswith("stopped the proxy and both workers")
    assert not any(listening(port) for port in stack_ports(out))
    # What the built-in model is, said before its first answer.
    assert out.index(f"({BUILTIN_MODEL_NOTE})") < out.index("\n=== completion (")
    # Its answers read as text: no broken characters, never only whitespace.
    answers = _answers(out)
    assert len(answers) == 5 and "\ufffd" not in out
    assert all(answer.strip() and all(c.isprintable() or c in "\t\n" for c in answer) for answer in answers), answers


def _answers(out: str) -> list[str]:
    """The text each of the demo's five requests got, from its output (completions print prompt + text)."""
    sections = out.split("\n=== ")[1:]
    sections[-1] = sections[-1].split("\nstopped the proxy")[0]
    answers = []
    for section in sections:
        title, _, body = section.partition("\n")
        prompt = next((p for p in PROMPTS if body.startswith(p)), "") if "completion" in title else ""
        answers.append(body[len(prompt):].rstrip("\n"))
    return answers


@needs_di
@pytest.mark.slow  # test_neuron_di.py's Ctrl-C test covers the stack's signal handling by default
def test_ctrl_c_stops_the_whole_stack(tmp_path):
    status, out = interrupted_run(tmp_path / "demo.log", "examples/demo_1p1d.py", "--max-tokens", "200", marker="serving ")
    assert status == 130, out
    assert "interrupted; every process was stopped" in out
    assert not any(listening(port) for port in stack_ports(out))


def test_demo_reports_a_stack_that_cannot_start(tmp_path):
    result = run_script("examples/demo_1p1d.py", "--model", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert "demo failed: the " in result.stderr and "worker exited with status" in result.stderr
