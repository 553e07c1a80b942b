"""A load's progress bar: drawn on a terminal and cleared after, never on a pipe or when unnamed."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from stack.serving import ROOT

LOAD = """
from benchmarks.serving_load import progress
with progress(5, {what!r}) as bar:
    for _ in range(5):
        bar.update()
print("counted", bar.n)
"""


def _on_terminal(code: str) -> str:
    """What `code` writes to a 100-column terminal (stdout and stderr)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of 100 columns, then Python running `code`
        fcntl.ioctl(2, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-c", code])
    out = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    os.waitpid(pid, 0)
    return out.decode(errors="replace")


def test_a_named_load_draws_its_bar_on_a_terminal_and_clears_it() -> None:
    text = _on_terminal(LOAD.format(what="turns"))
    assert "\rturns: " in text and "/5 [" in text, text   # at least its first frame (frames are 0.1 s apart)
    assert text.endswith("\r" + " " * 99 + "\rcounted 5\r\n"), repr(text[-150:])   # the line wiped after


def test_an_unnamed_load_or_a_pipe_gets_no_bar() -> None:
    assert _on_terminal(LOAD.format(what=None)) == "counted 0\r\n"   # a disabled bar counts nothing
    piped = subprocess.run([sys.executable, "-c", LOAD.format(what="turns")], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=True)
    assert (piped.stdout, piped.stderr) == ("counted 0\n", "")
