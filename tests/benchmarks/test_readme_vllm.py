"""The vLLM 1P1D commands of docs/vllm.md are the ones stack/vllm_readme.py builds (and
benchmarks/contended_host.py runs)."""
from __future__ import annotations

import re
from pathlib import Path

from stack.vllm_readme import shell_lines

VLLM_PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def test_vllm_page_shows_the_vllm_commands_the_scripts_run() -> None:
    # Shell line continuations joined, and the JSON's line breaks (after a comma, inside its quotes).
    text = re.sub(r",\n\s+", ", ", re.sub(r"\\\n\s*", "", VLLM_PAGE.read_text()))
    for line in shell_lines():
        assert line in text, f"docs/vllm.md lacks: {line}"
