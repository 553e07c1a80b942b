"""What every benchmark script's command line does alike: --quick defaults, --systems, SIGTERM,
the JSON result file."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence


def fill_defaults(args: argparse.Namespace, defaults: Mapping[str, tuple[Any, Any]]) -> None:
    """Unset options take the first value of their pair, or the second with --quick."""
    for name, values in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, values[1] if args.quick else values[0])


def parse_systems(parser: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """The comma-separated subset of `known`; exits with status 2 on an unknown or empty one."""
    systems = [s for s in text.split(",") if s]
    unknown = sorted(set(systems) - set(known))
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown}, choose from {','.join(known)}")
    return systems


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every started process is stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def interrupted(prog: str) -> int:
    """Exit status of a run stopped by Ctrl-C or SIGTERM (its stacks are already stopped by then)."""
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130


def write_json(path: Path | None, out: Mapping[str, Any]) -> None:
    """Writes `out` as strict JSON to `path` (if given), making its directory."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, allow_nan=False))
    print(f"wrote {path}")
