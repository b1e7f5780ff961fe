"""The paged KV pool: one preallocated tensor of fixed-size blocks shared by all sessions.

Storage is `[layers, 2, kv_heads, blocks * block_size, head_dim]`. A session's blocks form
one contiguous *extent* (so attention reads it as a zero-copy view, with no gather), placed in
the middle of the largest free gap so that neighbours can grow in place; when it cannot grow
in place it moves to a new extent (amortised like a growing array), and when no gap is large
enough but enough blocks are free, extents are compacted. Sessions that start with the same
system prompt share the full blocks of its tokens (a ref-counted prefix extent), so each extra
session pays only for its own tokens.

The allocator separates questions (`can_allocate`, `free_blocks`) from the calls that change
state (`allocate`, `extend`, `release`, `retain`). Only the engine thread uses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from .errors import Code, EngineError
from .kvcache import KVShape
from .models import cache_root

log = logging.getLogger(__name__)


class OutOfBlocks(EngineError):
    code = Code.KV_BUDGET_EXCEEDED


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def default_budget_bytes(device: torch.device) -> int:
    """Half of the memory available now (device memory on CUDA), at least 256 MiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(256 << 20, free // 2)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = 8 << 30
    return max(256 << 20, available // 2)


class Extent:
    """A contiguous run of blocks with one owner; the pool moves it during compaction."""

    __slots__ = ("start", "blocks")

    def __init__(self, start: int, blocks: int) -> None:
        self.start, self.blocks = start, blocks


class BlockPool:
    def __init__(self, shape: KVShape, budget_bytes: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.shape = shape
        self.block_size = block_size
        self.block_bytes = shape.bytes_per_token * block_size
        self.num_blocks = budget_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {self.block_bytes} bytes")
        self.budget_bytes = self.num_blocks * self.block_bytes
        # Untouched pages of this tensor cost no memory until written (on Linux, CPU).
        self.storage = torch.empty((shape.layers, 2, shape.kv_heads, self.num_blocks * block_size, shape.head_dim),
                                   dtype=shape.dtype, device=shape.device)
        self.refs = np.zeros(self.num_blocks, dtype=np.int32)  # 0 = free; > 1 only for shared prefixes
        self.extents: list[Extent] = []
        self.prefixes: dict[str, SharedPrefix] = {}
        self.compactions = 0
        self.moves = 0

    # ---- questions ---------------------------------------------------------------------------

    def free_blocks(self) -> int:
        return int(self.num_blocks - np.count_nonzero(self.refs))

    def used_bytes(self) -> int:
        return (self.num_blocks - self.free_blocks()) * self.block_bytes

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= self.free_blocks()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- state changes -----------------------------------------------------------------------

    def allocate(self, blocks: int) -> Extent:
        """A new extent of `blocks` blocks (compacting if the free space is fragmented)."""
        if blocks < 1:
            raise ValueError(f"allocate needs >= 1 block, got {blocks}")
        start = self._place(blocks)
        if start is None:
            if not self.can_allocate(blocks):
                raise OutOfBlocks(f"the KV budget of {_size(self.budget_bytes)} ({self.num_blocks} blocks of "
                                  f"{self.block_size} tokens) has {self.free_blocks()} free blocks, {blocks} needed")
            self.compact()
            start = self._place(blocks)
        extent = Extent(start, blocks)
        self.refs[start:start + blocks] = 1
        self.extents.append(extent)
        return extent

    def extend(self, extent: Extent, more: int) -> bool:
        """Grow an extent in place if the blocks after it are free."""
        end = extent.start + extent.blocks
        if end + more > self.num_blocks or self.refs[end:end + more].any():
            return False
        self.refs[end:end + more] = 1
        extent.blocks += more
        return True

    def shrink(self, extent: Extent, blocks: int) -> None:
        """Give back the blocks of an extent past its first `blocks` (at least one is kept)."""
        blocks = max(1, blocks)
        if blocks < extent.blocks:
            self.refs[extent.start + blocks:extent.start + extent.blocks] = 0
            extent.blocks = blocks

    def release(self, extent: Extent) -> None:
        s, n = extent.start, extent.blocks
        self.refs[s:s + n] -= 1
        if not self.refs[s:s + n].any():
            self.extents.remove(extent)

    def retain(self, extent: Extent) -> None:
        self.refs[extent.start:extent.start + extent.blocks] += 1

    def slots(self, extent: Extent) -> slice:
        return slice(extent.start * self.block_size, (extent.start + extent.blocks) * self.block_size)

    def compact(self, last: Extent | None = None) -> None:
        """Move every extent down to close the gaps (data moves with it); `last`, if given,
        goes after all the others, so that it can then grow into the free space."""
        self.compactions += 1
        held = None
        if last is not None:  # lift it out first: the others may slide over where it was
            held = (self.storage[:, :, :, self.slots(last)].clone(), int(self.refs[last.start]))
            self.refs[last.start:last.start + last.blocks] = 0
        cursor = 0
        for extent in sorted((e for e in self.extents if e is not last), key=lambda e: e.start):
            if extent.start != cursor:
                self._move(extent, cursor)
            cursor += extent.blocks
        if held is not None:
            last.start = cursor
            self.storage[:, :, :, self.slots(last)] = held[0]
            self.refs[cursor:cursor + last.blocks] = held[1]

    def move(self, extent: Extent, blocks: int) -> None:
        """Relocate an extent into a new one of `blocks` blocks (>= its size), keeping its data."""
        old = Extent(extent.start, extent.blocks)
        refs = int(self.refs[extent.start])
        self.refs[old.start:old.start + old.blocks] = 0  # free it while placing
        start = self._place(blocks)
        if start is None:
            self.refs[old.start:old.start + old.blocks] = refs
            if not self.can_allocate(blocks - old.blocks):
                raise OutOfBlocks(f"the KV budget of {_size(self.budget_bytes)} has {self.free_blocks()} "
                                  f"free blocks, {blocks - old.blocks} more needed")
            self.compact(last=extent)
            if not self.extend(extent, blocks - extent.blocks):
                raise RuntimeError("compaction left no room to grow the last extent")  # cannot happen
            return
        self.moves += 1
        src = self.slots(old)
        dst = slice(start * self.block_size, (start + old.blocks) * self.block_size)
        self.storage[:, :, :, dst] = self.storage[:, :, :, src].clone()
        self.refs[start:start + blocks] = refs
        extent.start, extent.blocks = start, blocks

    def _move(self, extent: Extent, start: int) -> None:
        src = self.slots(extent)
        refs = int(self.refs[extent.start])
        self.refs[extent.start:extent.start + extent.blocks] = 0
        self.storage[:, :, :, start * self.block_size:start * self.block_size + (src.stop - src.start)] = \
            self.storage[:, :, :, src].clone()
        self.refs[start:start + extent.blocks] = refs
        extent.start = start

    def _place(self, blocks: int) -> int | None:
        """Where a new extent goes: in the largest free gap, in its middle when an extent sits
        right before the gap (so that one can still grow), else at the gap's start."""
        free = np.concatenate(([False], self.refs == 0, [False]))
        edges = np.flatnonzero(np.diff(free.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]  # free runs [start, end)
        if len(starts) == 0:
            return None
        longest = int(np.argmax(ends - starts))
        best_start, best_len = int(starts[longest]), int(ends[longest] - starts[longest])
        if best_start is None or best_len < blocks:
            return None
        if best_start == 0:
            return 0
        return best_start + (best_len - blocks) // 2

    def stats(self) -> dict:
        free = self.free_blocks()
        return {"blocks": self.num_blocks, "block_size": self.block_size, "free_blocks": free,
                "used_bytes": (self.num_blocks - free) * self.block_bytes, "budget_bytes": self.budget_bytes,
                "extents": len(self.extents), "shared_prefixes": len(self.prefixes),
                "compactions": self.compactions, "moves": self.moves}

    # ---- shared prefixes -----------------------------------------------------------------------

    def prefix_for(self, tokens: list[int]) -> "SharedPrefix | None":
        """The shared extent for the full blocks of `tokens` (created on first use), retained
        for the caller; None when there is not one full block."""
        full = len(tokens) // self.block_size * self.block_size
        if full == 0:
            return None
        key = hashlib.sha256(repr(tokens[:full]).encode()).hexdigest()
        prefix = self.prefixes.get(key)
        if prefix is None:
            prefix = SharedPrefix(self, key, self.allocate(full // self.block_size), tokens[:full])
            self.prefixes[key] = prefix
        else:
            self.retain(prefix.extent)
        prefix.users += 1
        return prefix


@dataclass(eq=False)
class SharedPrefix:
    """Full blocks of a system prompt's tokens, shared by the sessions that start with it.
    It is also a (tiny) cache in its own right, so the first session can prefill it."""

    pool: BlockPool
    key: str
    extent: Extent
    tokens: list[int]
    users: int = 0
    filled: bool = False  # its K/V are written (by the first session that used it)
    prefix_len = 0  # as a cache it has no prefix of its own
    prefix = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def max_tokens(self) -> int:
        return len(self.tokens)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.pool.slots(self.extent)
        return self.pool.storage[index, 0, :, slots], self.pool.storage[index, 1, :, slots]

    def storage(self) -> tuple[torch.Tensor, int]:
        """The pool storage `[layers, 2, kv_heads, slots, head_dim]` and the slot of position 0."""
        return self.pool.storage, self.pool.slots(self.extent).start

    def reserve(self, total: int) -> None:
        if total > len(self.tokens):
            raise ValueError(f"shared prefix holds {len(self.tokens)} tokens, {total} requested")

    def commit(self, length: int) -> None:
        if length == len(self.tokens):
            self.filled = True

    def drop(self) -> None:
        self.users -= 1
        self.pool.release(self.extent)
        if self.users == 0:
            del self.pool.prefixes[self.key]


def park_dir() -> str:
    path = os.path.join(cache_root(), "parked")
    os.makedirs(path, exist_ok=True)
    return path


class PagedCache:
    """A session's reading cache in the pool: an optional shared prefix of `prefix_len` tokens,
    then the session's own extent. `length` and every position are logical (prefix included);
    `layer(i)` returns the own part, whose slot 0 is logical position `prefix_len`."""

    def __init__(self, pool: BlockPool, max_tokens: int, prefix: SharedPrefix | None = None) -> None:
        self.pool = pool
        self.shape = pool.shape
        self.max_tokens = max_tokens
        self.prefix = prefix
        self.prefix_len = prefix.length if prefix is not None else 0
        self.length = self.prefix_len  # the prefix is present once its fill job (if any) has run
        self.extent: Extent | None = None
        self.parked: torch.Tensor | str | None = None  # host copy or file of the own part
        self.parked_length = 0

    # ---- geometry ----------------------------------------------------------------------------

    @property
    def own_capacity(self) -> int:
        return self.extent.blocks * self.pool.block_size if self.extent is not None else 0

    @property
    def capacity(self) -> int:
        return self.prefix_len + self.own_capacity

    @property
    def nbytes(self) -> int:
        """Bytes of pool blocks this session holds on its own (its share of a prefix excluded)."""
        return self.extent.blocks * self.pool.block_bytes if self.extent is not None else 0

    def blocks_needed(self, total: int) -> int:
        """More blocks that `reserve(total)` would take (0 if it fits)."""
        own = self.pool.blocks_for(max(0, total - self.prefix_len))
        return max(0, own - (self.extent.blocks if self.extent is not None else 0))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.extent is None:
            empty = self.pool.storage[index, 0, :, :0]
            return empty, empty
        slots = self.pool.slots(self.extent)
        return self.pool.storage[index, 0, :, slots], self.pool.storage[index, 1, :, slots]

    def storage(self) -> tuple[torch.Tensor, int]:
        """The pool storage `[layers, 2, kv_heads, slots, head_dim]` and the slot of own position 0
        (reserved first)."""
        return self.pool.storage, self.pool.slots(self.extent).start

    def keys(self) -> torch.Tensor:
        """The own keys of every layer: a view `[layers, kv_heads, own_capacity, head_dim]`."""
        if self.extent is None:
            return self.pool.storage[:, 0, :, :0]
        return self.pool.storage[:, 0, :, self.pool.slots(self.extent)]

    # ---- state changes -----------------------------------------------------------------------

    def reserve(self, total: int) -> None:
        if total > self.max_tokens:
            raise ValueError(f"cache limit is {self.max_tokens} tokens, {total} requested")
        if self.parked is not None:
            self.restore()
        more = self.blocks_needed(total)
        if more == 0:
            return
        if self.extent is None:
            self.extent = self.pool.allocate(more)
        elif not self.pool.extend(self.extent, more):
            self.pool.move(self.extent, self.extent.blocks + more)

    def commit(self, length: int) -> None:
        if not self.prefix_len <= length <= self.capacity:
            raise ValueError(f"commit length {length} outside [{self.prefix_len}, {self.capacity}]")
        self.length = length

    def crop(self, length: int) -> None:
        if not self.prefix_len <= length <= self.length:
            raise ValueError(f"crop length {length} outside [{self.prefix_len}, {self.length}]")
        self.length = length

    def trim(self) -> None:
        """Give back blocks past the committed tokens (after a question's fork)."""
        if self.extent is not None:
            keep = self.pool.blocks_for(self.length - self.prefix_len)
            if keep == 0:
                self.pool.release(self.extent)
                self.extent = None
            else:
                self.pool.shrink(self.extent, keep)

    def remove(self, start: int, end: int) -> None:
        if not self.prefix_len <= start <= end <= self.length:
            raise ValueError(f"remove range [{start}, {end}) outside [{self.prefix_len}, {self.length}]")
        own = self.pool.storage[:, :, :, self.pool.slots(self.extent)]
        a, b, n = start - self.prefix_len, end - self.prefix_len, self.length - self.prefix_len
        own[:, :, :, a:a + n - b] = own[:, :, :, b:n].clone()
        self.length -= end - start

    def release(self) -> None:
        """Give everything back (the session is closed)."""
        if self.extent is not None:
            self.pool.release(self.extent)
            self.extent = None
        if self.prefix is not None:
            self.prefix.drop()
            self.prefix = None
        if isinstance(self.parked, str):
            try:
                os.remove(self.parked)
            except OSError:
                pass
        self.parked = None

    # ---- parking -----------------------------------------------------------------------------

    def park(self, to_disk: bool = False, name: str = "session") -> int:
        """Move the own part out of the pool (host memory, or a file); returns blocks freed."""
        if self.parked is not None or self.extent is None:
            return 0
        n = self.length - self.prefix_len
        data = self.pool.storage[:, :, :, self.pool.slots(self.extent)][:, :, :, :n].to("cpu", copy=True)
        if to_disk:
            path = os.path.join(park_dir(), f"{name}-{os.getpid()}-{id(self)}.pt")
            torch.save(data, path)
            self.parked = path
        else:
            self.parked = data
        self.parked_length = n
        freed = self.extent.blocks
        self.pool.release(self.extent)
        self.extent = None
        return freed

    def restore(self) -> None:
        data = self.parked
        if data is None:
            return
        if isinstance(data, str):
            data = torch.load(data)
        n = self.parked_length
        if n:
            self.extent = self.pool.allocate(self.pool.blocks_for(n))
            own = self.pool.storage[:, :, :, self.pool.slots(self.extent)]
            own[:, :, :, :n] = data.to(own.device)
        if isinstance(self.parked, str):
            os.remove(self.parked)
        self.parked = None

    # ---- copies ------------------------------------------------------------------------------

    def snapshot(self) -> torch.Tensor:
        """The committed K/V, prefix included, as one tensor (tests, replay checks)."""
        parts = []
        if self.prefix is not None:
            parts.append(self.pool.storage[:, :, :, self.pool.slots(self.prefix.extent)][:, :, :, :self.prefix_len])
        if self.length > self.prefix_len:
            parts.append(self.pool.storage[:, :, :, self.pool.slots(self.extent)][:, :, :, :self.length - self.prefix_len])
        if not parts:
            s = self.shape
            return torch.empty((s.layers, 2, s.kv_heads, 0, s.head_dim), dtype=s.dtype, device=s.device)
        return torch.cat(parts, dim=3).clone()

    def clone(self, length: int | None = None) -> "PagedCache":
        length = self.length if length is None else length
        if not self.prefix_len <= length <= self.length:
            raise ValueError(f"clone length {length} outside [{self.prefix_len}, {self.length}]")
        copy = PagedCache(self.pool, self.max_tokens, self.prefix)
        if self.prefix is not None:
            self.pool.retain(self.prefix.extent)
            self.prefix.users += 1
        copy.reserve(length)
        n = length - self.prefix_len
        if n:
            src = self.pool.storage[:, :, :, self.pool.slots(self.extent)][:, :, :, :n]
            self.pool.storage[:, :, :, self.pool.slots(copy.extent)][:, :, :, :n] = src
        copy.length = length
        return copy
