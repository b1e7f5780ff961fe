"""Checkpoints: what a session's window holds now, so recovery costs a window, not a history.

`capture(core, session_id)` (an engine-thread command) returns the session's state as a
JSON-able dict (its inputs with their seqs, tokens and positions, clocks, window, thinking
state with its notes, flash questions with their answers) and its tensors: the reading
cache's own K/V (every layer: restore is exact for any model depth), the dual thinking cache
and the last logits. `pack` turns the tensors into one content-addressed blob (a JSON header
and raw little-endian bytes: nothing is unpickled on restore). `restore(core, session_id,
state, tensors)` puts both back into a session just created from the same `create` record,
so the restored session equals the live one at the checkpoint: same tokens at the same
positions, the same K/V bits, the same seqs and data_version, the same flash answers.

A session whose FIFO still holds work (an input not read to its end), or that is writing a
note, is not captured: `capture` returns None and the caller tries again a little later.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, fields
from typing import TYPE_CHECKING

import torch

from . import flash, thinking, window
from .errors import Code, EngineError
from .kvcache import own_slots
from .session import Chunk, Session, restore_log

if TYPE_CHECKING:
    from .engine import EngineCore

FORMAT = 1
_HEADER = struct.Struct("<I")


class CheckpointError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code=Code.REPLAY_FAILED, recoverable=False)


# ---- capture ------------------------------------------------------------------------------------


def capture(core: EngineCore, session_id: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """The session's state and tensors, or None while its FIFO still holds work."""
    session: Session = core.live(session_id)
    if core.lanes.fifo.get(session_id) or session.pending_tokens or core.lanes.side.get(session_id, {}).get("think"):
        return None  # an input not read to its end, or a note being written: not a state to keep
    cache = session.cache
    if cache.parked is not None:
        cache.restore()
    tensors = {"kv": own_kv(cache).to("cpu", copy=True)}
    logits = session.last_logits
    if logits is not None:
        tensors["logits"] = logits.detach().to("cpu", copy=True)
    state = {
        "format": FORMAT,
        "length": cache.length,
        "prefix_len": cache.prefix_len,
        "prefix_ids": list(session.prefix_ids),
        "chunks": [_chunk(c) for c in session.chunks],
        "data_version": session.data_version,
        "next_seq": session.next_seq,
        "position_offset": session.position_offset,
        "frames": session.frames,
        "media_s": session.media_s,
        "ended": session.ended,
        "crop_epoch": session.crop_epoch,
        "segments": dict(session.segments),
        "next_flash_id": session.flash.next_id,
        "flash": [_flash(q) for q in session.flash.questions.values()],
        "window": _window(session.window),
        "thinking": _thinking(session, tensors),
    }
    return state, tensors


def own_kv(cache) -> torch.Tensor:
    """The cache's own committed K/V `[layers, 2, kv_heads, n, head_dim]` (a shared prefix excluded)."""
    n = cache.length - cache.prefix_len
    if getattr(cache, "pool", None) is not None:
        if cache.extent is None:
            return cache.pool.storage[:, :, :, :0]
        return cache.pool.storage[:, :, :, cache.pool.slots(cache.extent)][:, :, :, :n]
    return cache.snapshot()


def _chunk(c: Chunk) -> dict:
    return {"seq": c.seq, "ts": c.ts, "text": c.text, "start": c.start, "tokens": list(c.tokens), "digest": c.digest,
            "extent": c.extent, "media_s": c.media_s}


def _flash(q) -> dict:
    return {"args": {"question": q.question, "flash_id": q.flash_id, "max_tokens": q.max_tokens,
                     "priority": q.priority, "min_interval_s": q.min_interval_s, "confirm": q.confirm,
                     **{f.name: getattr(q.penalties, f.name) for f in fields(q.penalties)}},
            "answer": asdict(q.answer) if q.answer is not None else None,
            "candidate": q.candidate, "candidate_count": q.candidate_count,
            "evaluated_version": q.evaluated_version, "evaluations": q.evaluations, "stale": q.stale}


def _window(window) -> dict | None:
    return None if window is None else asdict(window)


def _thinking(session: Session, tensors: dict) -> dict | None:
    state = session.thinking
    if state is None:
        return None
    if state.cache is not None:
        tensors["think"] = state.cache.snapshot().to("cpu", copy=True)
    return {"config": asdict(state.config), "units": [asdict(u) for u in state.units], "written": state.written,
            "last_position": state.last_position, "seen_tokens": state.seen_tokens, "seen_seq": state.seen_seq,
            "final_requested": state.final_requested, "final_done": state.final_done,
            "dropped_units": state.dropped_units, "repeated_units": state.repeated_units,
            "notes": list(state.notes.items())}


# ---- restore ------------------------------------------------------------------------------------


def restore(core: EngineCore, session_id: str, state: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Put a captured state into `session_id`, a session just created (its framing read) from
    the same `create` record; returns its state."""
    session: Session = core.live(session_id)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {state.get('format')!r} is not {FORMAT}")
    if list(session.prefix_ids) != state["prefix_ids"] or session.cache.prefix_len != state["prefix_len"]:
        raise CheckpointError(f"session {session_id}: the checkpoint's framing does not match this worker's "
                              "(another model or tokenizer?)")
    _restore_kv(session.cache, state["length"], tensors["kv"])
    logits = tensors.get("logits")
    restore_log(session, state, logits.to(session.runner.device) if logits is not None else None)
    window.restore(session, state["window"])  # each feature puts back its own state
    flash.restore(core, session, state["flash"], state["next_flash_id"])
    thinking.restore(session, state["thinking"], tensors.get("think"))
    return session.state()


def _restore_kv(cache, length: int, kv: torch.Tensor) -> None:
    n = length - cache.prefix_len
    if kv.shape[3] != n:
        raise CheckpointError(f"checkpoint K/V holds {kv.shape[3]} tokens, its state says {n}")
    cache.crop(cache.prefix_len)
    cache.reserve(length)
    if n:
        own = own_slots(cache)
        if own.shape[:3] != kv.shape[:3] or own.shape[4] != kv.shape[4]:
            raise CheckpointError(f"checkpoint K/V of shape {tuple(kv.shape)} does not fit this model's cache "
                                  f"{tuple(own.shape)}")
        own[:, :, :, :n] = kv.to(device=own.device, dtype=own.dtype)
    cache.commit(length)


# ---- the blob -----------------------------------------------------------------------------------


def pack(tensors: dict[str, torch.Tensor]) -> tuple[str, bytes]:
    """(sha256 hex, bytes) of the tensors: a 4-byte header length, a JSON header (name, dtype,
    shape, offset, size) and each tensor's raw bytes."""
    header, parts, offset = [], [], 0
    for name, t in tensors.items():
        raw = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "offset": offset, "size": len(raw)})
        parts.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    data = _HEADER.pack(len(head)) + head + b"".join(parts)
    return hashlib.sha256(data).hexdigest(), data


def unpack(data: bytes, digest: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a blob made by `pack` (CheckpointError if it is not one, or not `digest`)."""
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"checkpoint blob {digest[:16]} does not read back as itself")
    try:
        (size,) = _HEADER.unpack_from(data)
        header = json.loads(data[_HEADER.size:_HEADER.size + size])
        body = memoryview(data)[_HEADER.size + size:]
        out = {}
        for item in header:
            dtype = getattr(torch, item["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype {item['dtype']!r}")
            raw = body[item["offset"]:item["offset"] + item["size"]]
            if len(raw) != item["size"]:
                raise ValueError(f"tensor {item['name']} is cut off")
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if item["size"] else torch.empty(0, dtype=torch.uint8)
            out[item["name"]] = flat.view(dtype).reshape(item["shape"])
        return out
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, struct.error) as exc:
        raise CheckpointError(f"checkpoint blob is malformed: {exc}") from None
