"""The command-line flags of image parts and their embeddings (kept free of heavy imports)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Where image parts may be read from, and the registered region their rows wait or arrive in."""
    group = parser.add_argument_group("image parts (roles encode, prefill and both)")
    group.add_argument("--allowed-local-media-path", default=None,
                       help="directory image parts may name local files in (default: no local files)")
    group.add_argument("--max-file-size-mb", type=float, default=50.0,
                       help="largest image part file or download, in MB (default 50)")
    group.add_argument("--embeds-region-mb", type=float, default=64.0,
                       help="MB of registered memory for embedding rows: waiting to be pulled on encode, "
                            "arriving on prefill (default 64)")
    group.add_argument("--embeds-ttl", type=float, default=60.0,
                       help="encode: free the rows of an image part not pulled within this many seconds (default 60)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.embeds_region_mb > 0 and args.embeds_ttl > 0 and args.max_file_size_mb > 0):
        parser.error("--embeds-region-mb, --embeds-ttl and --max-file-size-mb must be positive")
