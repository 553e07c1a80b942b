"""The chained hash of a full KV block: what a worker's prefix cache and the proxy's estimate of it key on.

Each block's hash folds in the one before it, so equal hashes mean equal prefixes (a cache still checks
the token ids before it trusts one). Both sides must compute it alike: it lives here, where both see it.
"""
from __future__ import annotations

import hashlib
from array import array

Media = tuple[tuple[int, int, str], ...]   # (start, length, digest) of each image span a block holds


def chain_hash(token_ids: list[int], prev_hash: int | None, media: Media = ()) -> int:
    """Hash of a full block folding in the hash of everything before it and the images it holds
    (placeholder token ids are the same for every image: only the digests tell them apart)."""
    h = hashlib.blake2b(digest_size=8)
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    for start, length, digest in media:
        h.update(f"|{start},{length},{digest}".encode())
    return int.from_bytes(h.digest(), "little")
