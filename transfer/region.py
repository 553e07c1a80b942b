"""KV regions: the registered pool tensor, in plain host memory or POSIX shared memory."""
from __future__ import annotations

import os
import socket
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.pid import pid_alive
from transfer.errors import LayoutMismatch, RegionNotRegistered
from transfer.fences import Fences
from transfer.fences import available as fences_available
from transfer.landing import LandingMarks
from transfer.layout import KVLayout

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "neuron-di-kv-"
# The segment starts with one page of header so the pool itself stays page aligned.
HEADER_BYTES = 4096
_PAGE = 4096
_REGISTERED, _UNREGISTERED = 1, 0


def host_identity() -> str:
    """Same string on two processes iff they can share a KV pool in shared memory.

    The boot id tells machines apart; the network and IPC namespaces tell apart containers
    and network namespaces on one machine, which share the hostname and the boot id but are
    separate hosts to their peers (a peer there is reached at another address, and may not
    see our /dev/shm). Processes of one namespace pair on one boot share the key.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = f"unknown-boot-{socket.gethostname()}"
    return f"{boot_id}/net:{_namespace('net')}/ipc:{_namespace('ipc')}"


def _namespace(kind: str) -> str:
    """The inode of this process's namespace of `kind`; "?" where /proc does not show it."""
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "?"


def pretouch(flat: torch.Tensor, write: bool) -> None:
    """Faults in every page now, so the first transfer does not pay for page faults."""
    if write:
        flat.zero_()
    else:
        int(flat[::_PAGE].sum())


class ShmSegment:
    """A named POSIX shared-memory file: a state header page, the pool bytes, then one handoff
    fence word per block (transfer.fences) and one landing mark per block (transfer.landing).

    The owner creates and unlinks it; peers map it by name. The header's state word lets
    a peer see that the owner unregistered the pool even though its mapping stays valid.
    """

    def __init__(self, name: str, pool_bytes: int, create: bool, num_blocks: int = 0) -> None:
        self.name = name
        self.owner = create
        total = HEADER_BYTES + pool_bytes + 16 * num_blocks
        whole = self._map(SHM_DIR / name, total, create)
        self.state = whole[:8].view(torch.int64)
        self.pool_flat = whole[HEADER_BYTES:HEADER_BYTES + pool_bytes]
        words = whole[HEADER_BYTES + pool_bytes:].view(torch.int64)
        self.fence_words, self.landing_words = words[:num_blocks], words[num_blocks:]
        if create:
            self.state[0] = _REGISTERED
            # An owner that exits without close() still removes its name from /dev/shm.
            weakref.finalize(self, unlink_segment, name)

    def _map(self, path: Path, total: int, create: bool) -> torch.Tensor:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        except FileNotFoundError as exc:
            raise RegionNotRegistered(f"peer shm segment {self.name} does not exist") from exc
        try:
            if create:
                os.ftruncate(fd, total)
            elif os.fstat(fd).st_size != total:
                raise LayoutMismatch(f"peer shm segment {self.name} has {os.fstat(fd).st_size} bytes, "
                                     f"expected {total}")
            # Mapping through our own fd: a name unlinked meanwhile is never re-created.
            whole = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=total, dtype=torch.uint8)
            pretouch(whole[HEADER_BYTES:], write=create)
            return whole
        except BaseException:
            if create:
                unlink_segment(self.name)
            raise
        finally:
            os.close(fd)

    @property
    def registered(self) -> bool:
        return int(self.state[0]) == _REGISTERED

    def release(self) -> None:
        """Owner: mark unregistered and unlink the name; the memory goes with the last mapping."""
        if self.owner:
            self.state[0] = _UNREGISTERED
            unlink_segment(self.name)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def reap_stale_segments() -> list[str]:
    """Unlinks pool segments whose owner process is gone (killed before it could unlink them).

    Names are `neuron-di-kv-<engine hex>-<owner pid>-<suffix>`; a live owner, or a name that
    does not parse, is left alone. Peers that still map a reaped segment keep their mapping.
    """
    reaped = []
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        parts = path.name[len(SHM_PREFIX):].split("-")
        if len(parts) != 3 or not parts[1].isdigit() or pid_alive(int(parts[1])):
            continue
        unlink_segment(path.name)
        reaped.append(path.name)
    return reaped


@dataclass(eq=False)
class Region:
    """The registered KV pool: a contiguous tensor of `layout.shape`."""

    layout: KVLayout
    tensor: torch.Tensor
    segment: ShmSegment | None = None
    flat: torch.Tensor = field(init=False)
    fences: Fences | None = field(init=False)
    marks: LandingMarks | None = field(init=False)

    def __post_init__(self) -> None:
        t = self.tensor
        if tuple(t.shape) != self.layout.shape or t.dtype != self.layout.torch_dtype:
            raise LayoutMismatch(f"tensor {tuple(t.shape)} {t.dtype} does not match layout "
                                 f"{self.layout.shape} {self.layout.dtype}")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise LayoutMismatch("a KV region must be a contiguous CPU tensor")
        self.flat = t.view(-1).view(torch.uint8)
        words = self.segment.fence_words if self.segment is not None else torch.zeros(
            self.layout.num_blocks, dtype=torch.int64)
        self.fences = Fences(words) if fences_available() and words.numel() == self.layout.num_blocks else None
        marks = self.segment.landing_words if self.segment is not None else torch.zeros_like(words)
        self.marks = LandingMarks(marks) if self.fences is not None else None

    @property
    def address(self) -> int:
        return self.flat.data_ptr()

    @classmethod
    def allocate(cls, layout: KVLayout, shm_name: str | None) -> Region:
        """A zeroed, pre-touched pool, in shared memory when `shm_name` is given."""
        if shm_name is None:
            flat = torch.empty(layout.total_bytes, dtype=torch.uint8)
            pretouch(flat, write=True)
            return cls(layout, _as_pool(flat, layout))
        segment = ShmSegment(shm_name, layout.total_bytes, create=True, num_blocks=layout.num_blocks)
        return cls(layout, _as_pool(segment.pool_flat, layout), segment)


def _as_pool(flat: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    return flat.view(layout.torch_dtype).view(layout.shape)
