"""Whether a process of this host still runs, by its pid."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` names a live process of this host (one of another user's counts as live)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
