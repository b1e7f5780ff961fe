"""A session moved between workers without re-reading it: export its caches and state as one
blob, import the blob into a session that another engine created the same way.

A drain (streamer.drain) exports each session on the worker that stops and the worker that
adopts it imports the blob instead of replaying the session's log: the input already in the
KV cache is not prefilled again. The blob holds

- the reading cache's committed K/V (the framing prefix included, so the importer checks that
  its own prefix, computed at creation, is the same), the thinking cache (dual mode) and the
  logits after the newest token, as raw tensors;
- the session's state as JSON: the inputs in the window (text, tokens, positions, seq), the
  clocks (`data_version`, `next_seq`, positions), flash questions and their answers, thinking
  notes and counters, the window's settings and counters.

Format: `MAGIC`, an 8-byte big-endian header length, the JSON header, then the raw tensor
bytes the header indexes (offset, byte count, dtype, shape). Decoding builds only the classes
listed in `_CLASSES` (never pickle: the blob crosses processes through a shared store).

Not carried: listeners (the new owner's connections attach their own), action rules and
running policies (as with replay, the client re-sends them), flash staleness histograms.
"""

from __future__ import annotations

import json
import struct
import time
from collections import OrderedDict, deque
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

import torch

from . import background, flash, query, thinking, window
from .errors import Code, EngineError
from .flash import FlashAnswer, FlashQuestion
from .kvcache import KVCache
from .sampling import Penalties
from .session import Chunk, adopt as adopt_log
from .thinking import ThinkingConfig, ThinkingState, Unit
from .window import TextWindow

if TYPE_CHECKING:
    from .engine import EngineCore

MAGIC = b"STREAMER-HANDOFF-1\n"
PREFIX_ATOL = 1e-4  # the importer's framing prefix against the exporter's (fp32: same computation)

# Session attributes carried (besides the caches and logits, which travel as tensors).
SESSION_FIELDS = ("chunks", "data_version", "next_seq", "position_offset", "frames", "media_s", "ended",
                  "created_at", "last_input_at", "queries_answered", "crop_epoch", "thinking", "window",
                  "segments", "version_times", "idle_turn")
# The FlashBoard's fields carried, under their names in the blob's state (the staleness histogram stays).
BOARD_FIELDS = {"flash": "questions", "next_flash_id": "next_id"}

# Fields that hold `time.monotonic()` readings: each process has its own clock, so they travel
# as an age and come back against the importer's clock.
_MONOTONIC = frozenset({("FlashQuestion", "last_eval_at"), ("Unit", "started_at"), ("Unit", "done_at")})

_CLASSES = {cls.__name__: cls for cls in (Chunk, FlashQuestion, FlashAnswer, Penalties, ThinkingConfig,
                                          ThinkingState, Unit, TextWindow)}


class HandoffError(EngineError):
    """A blob that cannot be imported here (malformed, another model, a session that differs):
    the caller falls back to replaying the session's log."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=Code.INVALID_FIELD)


# ---- export ------------------------------------------------------------------------------------


def export_session(core: EngineCore, session_id: str, extra: dict | None = None) -> bytes:
    """The blob of `session_id` (engine thread). Raises HandoffError while the session has work
    in flight (input accepted but not read yet, or a job running): export it when idle."""
    session = core.live(session_id)
    if session.pending_tokens or core.lanes.busy(session_id):
        raise HandoffError(f"session {session_id} has work in flight")
    if session.cache.parked is not None:
        session.cache.restore()
    tensors: list[torch.Tensor] = []
    state = {name: _encode(getattr(session, name), tensors) for name in SESSION_FIELDS}
    state |= {key: _encode(getattr(session.flash, name), tensors) for key, name in BOARD_FIELDS.items()}
    logits = session.last_logits
    header = {
        "session_id": session_id, "model": core.runner.name, "kv": _shape_of(session.cache.shape),
        "prefix_tokens": len(session.prefix_ids), "tokens": session.cache.length,
        "cache": _add(session.cache.snapshot(), tensors), "state": state,
        "logits": None if logits is None else _add(logits, tensors), **(extra or {}),
    }
    return pack(header, tensors)


def pack(header: dict, tensors: list[torch.Tensor]) -> bytes:
    raw, index, offset = [], [], 0
    for t in tensors:
        data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        index.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": offset, "nbytes": len(data)})
        raw.append(data)
        offset += len(data)
    text = json.dumps({**header, "tensors": index}).encode()
    return b"".join([MAGIC, struct.pack(">Q", len(text)), text, *raw])


def _add(t: torch.Tensor, tensors: list[torch.Tensor]) -> dict:
    tensors.append(t)
    return {"__tensor__": len(tensors) - 1}


def _shape_of(shape) -> dict:
    return {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "dtype": str(shape.dtype).removeprefix("torch.")}


def _encode(value, tensors: list[torch.Tensor]):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _add(value, tensors)
    if isinstance(value, KVCache):
        return {"__kvcache__": _add(value.snapshot(), tensors), "max_tokens": value.max_tokens}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, deque):
        return {"__deque__": [_encode(v, tensors) for v in value], "maxlen": value.maxlen}
    if isinstance(value, dict):
        kind = "__odict__" if isinstance(value, OrderedDict) else "__dict__"
        return {kind: [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if is_dataclass(value) and _CLASSES.get(type(value).__name__) is type(value):
        name = type(value).__name__
        return {"__dc__": name, "fields": {f.name: _field(name, f.name, getattr(value, f.name), tensors)
                                          for f in fields(value)}}
    raise HandoffError(f"cannot export a {type(value).__name__} of a session")


def _field(cls: str, name: str, value, tensors: list[torch.Tensor]):
    if (cls, name) in _MONOTONIC and value:
        return {"__ago__": time.monotonic() - value}
    return _encode(value, tensors)


# ---- import ------------------------------------------------------------------------------------


def unpack(blob: bytes) -> tuple[dict, list[torch.Tensor]]:
    """The header and tensors of a blob (HandoffError when it is not one)."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise HandoffError("not a session handoff blob")
    start = len(MAGIC) + 8
    (size,) = struct.unpack(">Q", blob[len(MAGIC):start])
    try:
        header = json.loads(blob[start:start + size])
        body = memoryview(blob)[start + size:]
        tensors = [_tensor(body, item) for item in header["tensors"]]
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise HandoffError(f"malformed handoff blob: {exc}") from None
    return header, tensors


def _tensor(body: memoryview, item: dict) -> torch.Tensor:
    dtype = getattr(torch, item["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {item['dtype']!r}")
    offset, nbytes = int(item["offset"]), int(item["nbytes"])
    if offset < 0 or offset + nbytes > len(body):
        raise ValueError("tensor outside the blob")
    data = torch.frombuffer(bytearray(body[offset:offset + nbytes]), dtype=torch.uint8)
    return data.view(dtype).reshape(item["shape"])


def import_session(core: EngineCore, session_id: str, blob: bytes) -> dict:
    """Make `session_id`, freshly created on this engine with the settings it was created with
    (its framing prefix in the cache, nothing read yet), the exported session (engine thread).
    Resolves to its state. Raises HandoffError if the blob is not for this model or session."""
    header, tensors = unpack(blob)
    session = core.live(session_id)
    _check(core, session, header, session_id)
    kv = tensors[_index(header["cache"])].to(session.cache.shape.device)
    state = {name: _decode(header["state"][name], tensors, core) for name in (*SESSION_FIELDS, *BOARD_FIELDS)}
    _write_cache(session.cache, kv)
    logits = header["logits"]
    # each part of the state into the session through the module that owns it
    flash.adopt(session, state.pop("flash"), state.pop("next_flash_id"))
    thinking.adopt(session, state.pop("thinking"))
    window.adopt(session, state.pop("window"))
    query.adopt(session, state.pop("queries_answered"))
    background.adopt(session, state.pop("idle_turn"))
    adopt_log(session, state, None if logits is None else tensors[_index(logits)].to(session.cache.shape.device))
    return session.state()


def _check(core: EngineCore, session, header: dict, session_id: str) -> None:
    if header.get("session_id") != session_id:
        raise HandoffError(f"the blob is of session {header.get('session_id')!r}, not {session_id!r}")
    if header.get("model") != core.runner.name or header.get("kv") != _shape_of(session.cache.shape):
        raise HandoffError(f"the blob is of model {header.get('model')!r}, this worker runs {core.runner.name!r}")
    if session.chunks or session.cache.length != len(session.prefix_ids):
        raise HandoffError(f"session {session_id} has read input already: a blob imports into a new session")
    if header.get("prefix_tokens") != len(session.prefix_ids):
        raise HandoffError("the blob's framing prefix differs from this session's")


def _write_cache(cache, kv: torch.Tensor) -> None:
    """Write the blob's K/V past the prefix this session computed itself (which must match)."""
    n, have = kv.shape[3], cache.length
    if n < have or not torch.allclose(cache.snapshot(), kv[:, :, :, :have], atol=PREFIX_ATOL, rtol=0):
        raise HandoffError("the blob's framing prefix K/V differ from this session's")
    cache.reserve(n)
    storage, slot0 = cache.storage()
    own = slot0 - cache.prefix_len  # storage slot of logical position 0 of the own part
    storage[:, :, :, own + have:own + n] = kv[:, :, :, have:n].to(storage.dtype)
    cache.commit(n)


def _index(ref: dict) -> int:
    return int(ref["__tensor__"])


def _decode(value, tensors: list[torch.Tensor], core: EngineCore):
    if isinstance(value, list):
        return [_decode(v, tensors, core) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[_index(value)]
    if "__kvcache__" in value:
        kv = tensors[_index(value["__kvcache__"])]
        cache = core.runner.new_cache(int(value["max_tokens"]))
        cache.reserve(kv.shape[3])
        cache.storage()[0][:, :, :, :kv.shape[3]] = kv.to(cache.shape.device, cache.shape.dtype)
        cache.commit(kv.shape[3])
        return cache
    if "__ago__" in value:
        return time.monotonic() - float(value["__ago__"])
    if "__tuple__" in value:
        return tuple(_decode(v, tensors, core) for v in value["__tuple__"])
    if "__deque__" in value:
        return deque((_decode(v, tensors, core) for v in value["__deque__"]), maxlen=value["maxlen"])
    if "__dict__" in value or "__odict__" in value:
        ordered = "__odict__" in value
        pairs = ((_decode(k, tensors, core), _decode(v, tensors, core))
                 for k, v in value["__odict__" if ordered else "__dict__"])
        return OrderedDict(pairs) if ordered else dict(pairs)
    if "__dc__" in value:
        cls = _CLASSES.get(value["__dc__"])
        if cls is None:
            raise HandoffError(f"the blob names an unknown class {value['__dc__']!r}")
        obj = object.__new__(cls)  # no __post_init__: the fields are the exported ones, already checked
        known = {f.name for f in fields(cls)}
        for name, item in value["fields"].items():
            if name not in known:
                raise HandoffError(f"the blob sets an unknown field {name!r} of {cls.__name__}")
            object.__setattr__(obj, name, _decode(item, tensors, core))  # frozen ones too (Penalties)
        return obj
    raise HandoffError(f"malformed value in the blob: {sorted(value)[:3]}")
