"""What `neuron_di.py` reports, sans I/O: output comparison and KV-transfer statistics.

Blocks and bytes per request follow from the prompt length and the KV layout (a transfer moves
whole blocks, the last one partly filled). Transfer time is known to the prefill worker, which
pushes the blocks: it is read from its `/metrics` (the `neuron_di_kv_transfer_seconds` histogram).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from scheduler import blocks_for

TRANSFER_PREFIX = "neuron_di_kv_transfer"


@dataclass(frozen=True, slots=True)
class Completion:
    """One prompt's greedy output: token count and text."""

    num_tokens: int
    text: str


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first prompt whose DI output differs from the reference."""

    index: int
    expected: Completion
    got: Completion


def first_mismatch(expected: Sequence[Completion], got: Sequence[Completion]) -> Mismatch | None:
    """The first differing output, or None when every output matches exactly."""
    if len(expected) != len(got):
        raise ValueError(f"{len(expected)} reference outputs but {len(got)} DI outputs")
    for index, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            return Mismatch(index, want, have)
    return None


def diverging_at(expected: str, got: str) -> int:
    """The first character position where two texts differ."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return min(len(expected), len(got))


@dataclass(frozen=True, slots=True)
class TransferSummary:
    """KV moved for a run of requests, and the worker's transfer time when it reports one."""

    num_requests: int
    num_blocks: int
    num_bytes: int
    transfer_seconds: float | None  # None: the decode worker exposes no transfer time
    num_transfers: int | None

    @property
    def gb_per_s(self) -> float | None:
        if not self.transfer_seconds:
            return None
        return self.num_bytes / self.transfer_seconds / 1e9

    @property
    def ms_per_transfer(self) -> float | None:
        if self.transfer_seconds is None or not self.num_transfers:
            return None
        return 1000 * self.transfer_seconds / self.num_transfers


SMALL_TRANSFER_BYTES = 64 * 2**20  # below this a transfer's fixed cost outweighs its copying time


def summarize(prompt_lengths: Iterable[int], block_size: int, block_bytes: int,
              metrics_text: str | None) -> TransferSummary:
    """Blocks and bytes from the prompts; time and transfer count from the decode worker's metrics."""
    lengths = list(prompt_lengths)
    num_blocks = sum(blocks_for(n, block_size) for n in lengths)
    seconds, count = transfer_time(metrics_text) if metrics_text else (None, None)
    return TransferSummary(len(lengths), num_blocks, num_blocks * block_bytes, seconds, count)


def transfer_time(metrics_text: str) -> tuple[float | None, int | None]:
    """(total seconds, number of transfers) from a `neuron_di_kv_transfer_*seconds` histogram, if any."""
    for family in text_string_to_metric_families(metrics_text):
        if not (family.name.startswith(TRANSFER_PREFIX) and family.name.endswith("seconds")):
            continue
        total = sum(s.value for s in family.samples if s.name.endswith("_sum"))
        count = sum(s.value for s in family.samples if s.name.endswith("_count"))
        return total, int(count)
    return None, None


def format_summary(summary: TransferSummary, block_bytes: int, extra: Sequence[tuple[str, str]] = ()) -> str:
    """The statistics as a small table, `extra` rows last."""
    n = max(summary.num_requests, 1)
    rows = [
        ("requests", f"{summary.num_requests}"),
        ("KV block size", f"{block_bytes:,} bytes"),
        ("blocks moved", f"{summary.num_blocks} ({summary.num_blocks / n:.1f} per request)"),
        ("bytes moved", f"{summary.num_bytes:,} ({summary.num_bytes / n / 1e6:.2f} MB per request)"),
    ]
    if summary.transfer_seconds is None:
        rows.append(("transfer time", "not reported (prefill /metrics has no "
                                       f"{TRANSFER_PREFIX}_seconds histogram)"))
    else:
        rows += [("transfer time", f"{summary.transfer_seconds * 1000:.1f} ms total, "
                                   f"{summary.ms_per_transfer or 0:.2f} ms per transfer"),
                 ("throughput", f"{summary.gb_per_s or 0:.3f} GB/s" + _small_transfers(summary))]
    rows += extra
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _small_transfers(summary: TransferSummary) -> str:
    """A note when transfers are too small for their rate to mean bandwidth."""
    per_transfer = summary.num_bytes / max(summary.num_transfers or summary.num_requests, 1)
    if per_transfer >= SMALL_TRANSFER_BYTES:
        return ""
    return (f" (transfers of {per_transfer / 1e6:.2f} MB: their fixed cost, not bandwidth, sets this; "
            "examples/bench_transfer.py measures bandwidth on 64 MiB-1 GiB)")
