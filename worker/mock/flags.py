"""The command line of the simulated engine (kept free of heavy imports)."""
from __future__ import annotations

import argparse
from pathlib import Path

from worker.mock.cost_model import CostModel

ENGINES = ("model", "mock")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("simulated engine (--engine mock)")
    group.add_argument("--engine", choices=ENGINES, default="model",
                       help="model: compute with the model's weights; mock: the same worker with the forward pass "
                            "replaced by a cost model and deterministic tokens, for tests at a scale this machine "
                            "cannot compute (default model)")
    group.add_argument("--mock-calibration", type=Path, default=None,
                       help="a `python -m benchmarks.bench_engine --json` report to take the costs from (default: "
                            "the report of the benchmark model on the project's 2-core machine)")
    group.add_argument("--mock-prefill-tokens-per-s", type=float, default=None,
                       help="prompt tokens one step prefills per second")
    group.add_argument("--mock-decode-base-ms", type=float, default=None,
                       help="decode step time at batch 0, in ms")
    group.add_argument("--mock-decode-per-seq-ms", type=float, default=None,
                       help="decode step time added by each sequence of the batch, in ms")


def cost_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CostModel | None:
    """The simulated engine's costs (None with --engine model); a bad flag or report exits with its name."""
    given = {"prefill_tokens_per_s": args.mock_prefill_tokens_per_s,
             "decode_base_s": None if args.mock_decode_base_ms is None else args.mock_decode_base_ms / 1000,
             "decode_per_seq_s": None if args.mock_decode_per_seq_ms is None else args.mock_decode_per_seq_ms / 1000}
    if args.engine != "mock":
        if args.mock_calibration is not None or any(v is not None for v in given.values()):
            parser.error("the --mock-* flags need --engine mock")
        return None
    try:
        base = CostModel.from_bench_engine(args.mock_calibration) if args.mock_calibration else CostModel()
        return CostModel(**{name: value if value is not None else getattr(base, name)
                            for name, value in given.items()})
    except ValueError as exc:
        parser.error(f"--engine mock: {exc}")
