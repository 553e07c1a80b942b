"""The command-line flags of image parts and their embeddings (kept free of heavy imports)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The registered region image rows wait (encode) or arrive (prefill) in, and how long they may wait."""
    group = parser.add_argument_group("image embeddings (roles encode and prefill)")
    group.add_argument("--embeds-region-mb", type=float, default=64.0,
                       help="MB of registered memory for embedding rows: waiting to be pulled on encode, "
                            "arriving on prefill (default 64)")
    group.add_argument("--embeds-ttl", type=float, default=60.0,
                       help="encode: free the rows of an image part not pulled within this many seconds (default 60)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.embeds_region_mb > 0 and args.embeds_ttl > 0):
        parser.error("--embeds-region-mb and --embeds-ttl must be positive")
