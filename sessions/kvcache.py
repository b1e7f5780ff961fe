"""A session's KV cache: preallocated buffers written at explicit positions.

Layout is one tensor `[layers, 2, kv_heads, capacity, head_dim]`. Tokens `[0, length)` are the
session's state; a step writes new tokens at `[length, length + n)` and commits them only if
the caller says so, so a question (a fork) costs no copy: it writes past `length` and is
rolled back by leaving `length` where it was. Growth reallocates with doubling, so appends
are amortised O(new tokens), never O(cache) per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        """Physical KV bytes per token: layers x 2 x kv_heads x head_dim x dtype size."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


@runtime_checkable
class KVBuffer(Protocol):
    """What the runner and the attention plans need of a cache: per-layer views of its own
    slots, an optional read-only shared prefix in front of them, and explicit growth and commit.
    Positions are logical: the prefix's `prefix_len` tokens come first, and `layer(i)`'s slot 0
    is logical position `prefix_len`. Implemented by `KVCache`, `pool.PagedCache` and
    `pool.SharedPrefix`."""

    length: int
    max_tokens: int
    prefix_len: int

    @property
    def prefix(self) -> "KVBuffer | None": ...

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def storage(self) -> tuple[torch.Tensor, int]:
        """The tensor `[layers, 2, kv_heads, slots, head_dim]` that `layer(i)` views, and the slot
        of own position 0: a step writes the new K/V of all its sequences there at once."""
        ...

    def reserve(self, total: int) -> None: ...

    def commit(self, length: int) -> None: ...


@runtime_checkable
class SessionCache(KVBuffer, Protocol):
    """A session's reading cache (`pool.PagedCache` in the engine, `KVCache` in tools and
    tests): a `KVBuffer` that can also be cropped, give back blocks, be parked out of memory
    and be snapshotted."""

    shape: KVShape

    @property
    def parked(self) -> object: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def crop(self, length: int) -> None: ...

    def trim(self) -> None: ...

    def release(self) -> None: ...

    def park(self, to_disk: bool = False, name: str = "session") -> int: ...

    def snapshot(self) -> torch.Tensor: ...


class KVCache:
    """Growable KV buffers for one session; `length` tokens are committed.

    It shares the interface of the pool's PagedCache: a private buffer has no shared prefix,
    cannot be parked, and has no pool blocks to trim or release."""

    min_capacity = 256
    prefix = None
    prefix_len = 0
    parked = None

    def __init__(self, shape: KVShape, max_tokens: int) -> None:
        self.shape = shape
        self.max_tokens = max_tokens
        self.length = 0
        self._buf = self._alloc(min(self.min_capacity, max_tokens))

    def _alloc(self, capacity: int) -> torch.Tensor:
        s = self.shape
        return torch.empty(
            (s.layers, 2, s.kv_heads, capacity, s.head_dim), dtype=s.dtype, device=s.device
        )

    @property
    def capacity(self) -> int:
        return self._buf.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (allocated, not only committed)."""
        return self._buf.numel() * self._buf.element_size()

    def reserve(self, total: int) -> None:
        """Make room for `total` tokens. Everything already written is kept, including a fork's
        uncommitted tokens past `length`, so a question may grow the cache mid-decode."""
        if total > self.max_tokens:
            raise ValueError(f"cache limit is {self.max_tokens} tokens, {total} requested")
        if total <= self.capacity:
            return
        capacity = min(self.max_tokens, max(total, 2 * self.capacity))
        buf = self._alloc(capacity)
        buf[:, :, :, : self.capacity] = self._buf
        self._buf = buf

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[kv_heads, capacity, head_dim]` of one layer's keys and values."""
        return self._buf[index, 0], self._buf[index, 1]

    def storage(self) -> tuple[torch.Tensor, int]:
        """The buffer `[layers, 2, kv_heads, capacity, head_dim]` and the slot of position 0."""
        return self._buf, 0

    def keys(self) -> torch.Tensor:
        """The keys of every layer at once: a view `[layers, kv_heads, capacity, head_dim]` of the
        own slots (re-anchoring rotates them in one pass)."""
        return self._buf[:, 0]

    def commit(self, length: int) -> None:
        if not 0 <= length <= self.capacity:
            raise ValueError(f"commit length {length} outside [0, {self.capacity}]")
        self.length = length

    def trim(self) -> None:
        """Nothing to give back: the buffer is private."""

    def release(self) -> None:
        """Nothing to give back: the buffer is freed with the object."""

    def park(self, to_disk: bool = False, name: str = "session") -> int:
        """A private buffer is not in the pool: parking it would free no blocks."""
        return 0

    def crop(self, length: int) -> None:
        """Forget tokens past `length` (used by revise)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length {length} outside [0, {self.length}]")
        self.length = length

    def remove(self, start: int, end: int) -> None:
        """Drop committed tokens `[start, end)`, moving the later ones down. Their keys keep the
        positions they were computed at (RoPE is already applied), so what stays is unchanged."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"remove range [{start}, {end}) outside [0, {self.length}]")
        tail = self._buf[:, :, :, end:self.length].clone()
        self._buf[:, :, :, start:start + tail.shape[3]] = tail
        self.length -= end - start

    def clone(self, length: int | None = None) -> "KVCache":
        """An independent cache holding the first `length` committed tokens (default all).
        Keys and values of a prefix do not depend on what follows, so this equals a cache
        that only ever read those tokens."""
        length = self.length if length is None else length
        if not 0 <= length <= self.length:
            raise ValueError(f"clone length {length} outside [0, {self.length}]")
        copy = KVCache(self.shape, self.max_tokens)
        copy.reserve(length)
        copy._buf[:, :, :, :length] = self._buf[:, :, :, :length]
        copy.length = length
        return copy

    def snapshot(self) -> torch.Tensor:
        """A copy of the committed part, for tests and parking."""
        return self._buf[:, :, :, : self.length].clone()


def own_slots(cache) -> torch.Tensor:
    """The K/V slots a cache owns past its shared prefix (a pool's blocks, or its own buffer), to
    write a restored cache's K/V into (checkpoints)."""
    if getattr(cache, "pool", None) is not None:
        return cache.pool.storage[:, :, :, cache.pool.slots(cache.extent)]
    return cache._buf
