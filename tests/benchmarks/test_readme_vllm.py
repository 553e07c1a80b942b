"""The README's vLLM 1P1D commands are the ones stack/vllm_readme.py builds (and
benchmarks/contended_host.py runs)."""
from __future__ import annotations

import re
from pathlib import Path

from stack.vllm_readme import shell_lines

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_shows_the_vllm_commands_the_scripts_run() -> None:
    # Shell line continuations joined, and the JSON's line breaks (after a comma, inside its quotes).
    text = re.sub(r",\n\s+", ", ", re.sub(r"\\\n\s*", "", README.read_text()))
    for line in shell_lines():
        assert line in text, f"README.md lacks: {line}"
