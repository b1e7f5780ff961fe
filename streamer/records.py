"""The event log's records: what a session accepted, in the order the engine applied it.

One dataclass per kind, each with `to_json` / `from_json` (the store keeps JSON objects with a
`kind`; the store adds `n`, its position, and the log adds `ts`) and one `apply(engine,
session_id)` that makes the same change again (replay, streamer.recovery). `check(result)`
compares what a replayed change produced with what was logged (the seq of an input), so a log
that does not replay exactly is refused instead of silently diverging.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from streamer.sessions.errors import Code, EngineError
from streamer.sessions.sampling import PENALTY_KEYS

FLASH_KEYS = ("question", "flash_id", "max_tokens", "priority", "min_interval_s", "confirm", *PENALTY_KEYS)
MAX_LOGGED_EVENT_IDS = 1024  # per session: the client event ids a log (its checkpoint) remembers


class ReplayError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code=Code.REPLAY_FAILED, recoverable=False)


@dataclass(slots=True, kw_only=True)
class Record:
    kind: ClassVar[str] = "record"
    not_logged: ClassVar[tuple[str, ...]] = ()  # fields set after loading (blobs), never written
    ts: float | None = None  # when it was logged
    n: int | None = None  # its position in the log (1-based), set by the store
    first: bool | None = None  # logged before it was applied (a refusal by the engine is replayed as one)

    def to_json(self) -> dict[str, Any]:
        body = {k: v for k, v in asdict(self).items() if v is not None and k != "n" and k not in self.not_logged}
        return {"kind": self.kind, **body}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Record":
        kind = data.get("kind")
        cls = KINDS.get(kind)
        if cls is None:
            raise ReplayError(f"unknown record kind {kind!r} at position {data.get('n')}")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise ReplayError(f"record {data.get('n')} ({kind}) is malformed: {exc}") from None

    def apply(self, engine, session_id: str, then_: Callable[[Future], None] | None = None) -> Future:
        """Make this change on `engine`; a future of the engine's result. `then_` is attached to
        that future before any work is queued (the event log's callback)."""
        raise NotImplementedError

    def check(self, result: Any) -> None:
        """Raise ReplayError if the replayed change differs from the logged one."""


@dataclass(slots=True, kw_only=True)
class Create(Record):
    kind: ClassVar[str] = "create"
    system_prompt: str | None = None
    thinking: dict | None = None
    window: dict | bool | None = None  # its settings; False: unbounded (window: null); absent: the default
    flash: list[dict] = field(default_factory=list)  # registrations with the ids they got
    tokens: dict | None = None  # capability token digests by role
    key: str | None = None  # the API key name that created it

    def apply(self, engine, session_id: str, then_=None) -> Future:
        window = None if self.window is False else (self.window or "default")
        return engine.create_session(self.system_prompt, session_id, self.flash or None, self.thinking, window,
                                     owner=self.key, then=then_)


@dataclass(slots=True, kw_only=True)
class Append(Record):
    kind: ClassVar[str] = "append"
    text: str
    seq: int | None = None  # the input seq the engine gave it
    client_seq: int | None = None
    source: str | None = None  # "media": an observation or transcript made on the server
    evicted: list[int] | None = None  # inputs the window evicted since the previous input (replay evicts them first)
    event_id: str | None = None  # the client event it came from (a Realtime item's), so a resend is told
    item_id: str | None = None  # ... and the Realtime item it is a part of

    def apply(self, engine, session_id: str, then_=None) -> Future:
        return engine.append(session_id, self.text, evict_first=self.evicted, then=then_)

    def check(self, result: Any) -> None:
        if self.seq is not None and result.seq != self.seq:
            raise ReplayError(f"record {self.n} ({self.kind}) replayed as seq {result.seq}, logged as seq {self.seq}")
        if not self.first and sorted(result.evicted_seqs or ()) != sorted(self.evicted or ()):  # logged after applied
            raise ReplayError(f"record {self.n} ({self.kind}) evicted inputs {result.evicted_seqs} on replay, "
                              f"logged {self.evicted or []}")


@dataclass(slots=True, kw_only=True)
class Revise(Append):
    kind: ClassVar[str] = "revise"
    from_seq: int | None = None

    def apply(self, engine, session_id: str, then_=None) -> Future:
        return engine.revise(session_id, self.text, self.from_seq, evict_first=self.evicted, then=then_)


@dataclass(slots=True, kw_only=True)
class Frame(Append):
    """A video frame read into the cache of a session on a vision-language model. The frame
    itself (resized as the vision tower saw it) is a content-addressed blob in the store, named
    by `blob` and written before this record; replay loads it (`load_blobs`) and reads it again."""

    kind: ClassVar[str] = "frame"
    blob: str
    frame_tokens: int
    label: str | None = None  # text read right before the frame (its media time)
    media_s: float | None = None
    image: Any = None  # not logged: the blob's frame, set by `load_blobs`
    not_logged: ClassVar[tuple[str, ...]] = ("image",)

    def apply(self, engine, session_id: str, then_=None) -> Future:
        from streamer.sessions.multimodal import frame_input

        runner = engine.runner
        if runner.vl is None:
            raise ReplayError(f"record {self.n} is a video frame; this worker's model {runner.name} reads no images")
        if self.image is None:
            raise ReplayError(f"record {self.n}: frame blob {self.blob[:16]} is not in the store (expired?)")
        label = runner.tokenize(self.label) if self.label else []
        frame = frame_input(runner.vl, self.image, self.frame_tokens, label, self.media_s)
        if frame.digest != self.blob:
            raise ReplayError(f"record {self.n}: frame blob {self.blob[:16]} does not read back as itself")
        return engine.append_frame(session_id, frame, self.text, evict_first=self.evicted, then=then_)


async def load_blobs(records: list[Record], store) -> None:
    """Fetch the frames that `frame` records name, and the tensors of a `checkpoint`, from the
    store (missing ones stay None)."""
    from streamer.sessions.checkpoint import unpack
    from streamer.sessions.multimodal import blob_frame

    for record in records:
        if store is None:
            return
        if isinstance(record, Frame):
            blob = await store.get_blob(record.blob)
            record.image = blob_frame(blob) if blob is not None else None
        elif isinstance(record, Checkpoint):
            blob = await store.get_blob(record.blob)
            record.tensors = unpack(blob, record.blob) if blob is not None else None


@dataclass(slots=True, kw_only=True)
class End(Record):
    kind: ClassVar[str] = "end"

    def apply(self, engine, session_id: str, then_=None) -> Future:
        return engine.end_input(session_id, then=then_)


@dataclass(slots=True, kw_only=True)
class FlashRegister(Record):
    kind: ClassVar[str] = "flash.register"
    question: str
    flash_id: str
    max_tokens: int | None = None
    priority: int | None = None
    min_interval_s: float | None = None
    confirm: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    end_bias: float | None = None
    event_id: str | None = None  # the client event it came from (a Realtime standing question's)

    @classmethod
    def of(cls, args: dict, state: dict, event_id: str | None = None) -> "FlashRegister":
        """A registration as logged: its arguments with the id the engine gave it."""
        return cls(**{k: v for k, v in args.items() if k in FLASH_KEYS and k != "flash_id"}, flash_id=state["flash_id"],
                   event_id=event_id)

    def arguments(self) -> dict:
        return {k: getattr(self, k) for k in FLASH_KEYS if getattr(self, k) is not None}

    def apply(self, engine, session_id: str, then_=None) -> Future:
        return engine.register_flash(session_id, **self.arguments(), then=then_)


@dataclass(slots=True, kw_only=True)
class FlashUnregister(Record):
    kind: ClassVar[str] = "flash.unregister"
    flash_id: str

    def apply(self, engine, session_id: str, then_=None) -> Future:
        return engine.unregister_flash(session_id, self.flash_id, then=then_)


@dataclass(slots=True, kw_only=True)
class Update(Record):
    kind: ClassVar[str] = "update"
    thinking: dict | None = None
    window: dict | None = None

    def apply(self, engine, session_id: str, then_=None) -> Future:
        if self.thinking is None:
            return self._window(engine, session_id, then_)
        if self.window is None:
            return engine.configure_thinking(session_id, self.thinking, then=then_)
        done = engine.configure_thinking(session_id, self.thinking)
        return then(done, lambda _: self._window(engine, session_id), then_)

    def _window(self, engine, session_id: str, then_=None) -> Future:
        if self.window is False:  # window: null
            return engine.configure_window(session_id, unbounded=True, then=then_)
        return engine.configure_window(session_id, **self.window, then=then_)


@dataclass(slots=True, kw_only=True)
class Close(Record):
    kind: ClassVar[str] = "close"
    reason: str | None = None

    def apply(self, engine, session_id: str, then_=None) -> Future:
        raise ReplayError(f"session {session_id} was closed")


@dataclass(slots=True, kw_only=True)
class Checkpoint(Record):
    """What the session's window held after the record before it (sessions/checkpoint.py):
    `state` (inputs with seqs, tokens and positions, clocks, window, thinking notes, flash
    questions and their answers) and `blob`, the content address of its K/V (every layer),
    thinking cache and last logits. Replay starts from the last one (streamer.recovery), and
    the log before it is compacted away (Store.compact). `client_seq`: the highest client seq
    the log held then (dedup of resends); `event_ids`: the client event ids the log held then
    ([event id, what it made] pairs, the newest MAX_LOGGED_EVENT_IDS: `note_event_ids`)."""

    kind: ClassVar[str] = "checkpoint"
    state: dict
    blob: str
    client_seq: int | None = None
    event_ids: list | None = None
    tensors: Any = None  # not logged: the blob's tensors, set by `load_blobs`
    not_logged: ClassVar[tuple[str, ...]] = ("tensors",)

    def apply(self, engine, session_id: str, then_=None) -> Future:
        from streamer.sessions.checkpoint import restore

        if self.tensors is None:
            raise ReplayError(f"record {self.n}: checkpoint blob {self.blob[:16]} is not in the store")
        return engine.call(lambda: restore(engine.core, session_id, self.state, self.tensors), then_,
                           session_id=session_id)

    def check(self, result: Any) -> None:
        if result["last_seq"] != (self.state["chunks"][-1]["seq"] if self.state["chunks"] else 0):
            raise ReplayError(f"record {self.n} (checkpoint) restored to last seq {result['last_seq']}")


@dataclass(slots=True, kw_only=True)
class Void(Record):
    """Fences a position whose write failed and was never applied (streamer.eventlog): a write
    that timed out and lands later finds the position taken. Replays as nothing."""

    kind: ClassVar[str] = "void"
    rid_of: str | None = None  # the id of the record that was not applied

    def apply(self, engine, session_id: str, then_=None) -> Future:
        done: Future = Future()
        if then_ is not None:
            done.add_done_callback(then_)
        done.set_result(None)
        return done


@dataclass(slots=True, kw_only=True)
class Received(Record):
    """A client event whose item is in the session now, when the records that put it there do
    not carry its id (an image or audio item of the Realtime door: the media path logs what it
    read). Logged after the item is in; replays as nothing."""

    kind: ClassVar[str] = "received"
    event_id: str
    item_id: str | None = None

    apply = Void.apply


KINDS: dict[str, type[Record]] = {cls.kind: cls for cls in (Create, Append, Revise, Frame, End, FlashRegister,
                                                            FlashUnregister, Update, Close, Checkpoint, Void, Received)}


def then(first: Future, make_second, done: Callable[[Future], None] | None = None) -> Future:
    """A future for `make_second(first's result)`, or first's error; `done` is attached to it
    before anything can resolve it."""
    out: Future = Future()
    if done is not None:
        out.add_done_callback(done)

    def relay(src: Future) -> None:
        if src.exception() is not None:
            out.set_exception(src.exception())
        else:
            out.set_result(src.result())

    def step(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
            return
        try:
            make_second(f.result()).add_done_callback(relay)
        except Exception as exc:
            out.set_exception(exc)

    first.add_done_callback(step)
    return out


def client_seq_of(records: list[Record]) -> int:
    """The highest client seq the log holds (0: none), a checkpoint's included: the client
    resends what is above it."""
    return max((getattr(r, "client_seq", None) or 0 for r in records), default=0)


def note_event_ids(seen: OrderedDict, data: dict) -> None:
    """Update `seen` (event id -> what its event made, oldest first, at most MAX_LOGGED_EVENT_IDS)
    with one logged record (its JSON): `item_id` and `texts` (how many of the item's text parts
    are in) from appends carrying an event id, `done` from a `received` record, `flash_id` from a
    registration, and a checkpoint's whole set."""
    kind = data.get("kind")
    if kind == "checkpoint":
        for event_id, entry in data.get("event_ids") or ():
            seen.pop(event_id, None)
            seen[event_id] = dict(entry)
    elif isinstance(data.get("event_id"), str):
        event_id = data["event_id"]
        entry = seen.pop(event_id, None) or {}
        if kind == "flash.register":
            entry = {"flash_id": data.get("flash_id")}
        elif kind == "received":
            entry = {"item_id": data.get("item_id"), "texts": entry.get("texts", 0), "done": True}
        elif entry.get("item_id") != data.get("item_id"):  # a new item under the id (an earlier one failed)
            entry = {"item_id": data.get("item_id"), "texts": 1}
        else:
            entry["texts"] = entry.get("texts", 0) + 1
        seen[event_id] = entry
    while len(seen) > MAX_LOGGED_EVENT_IDS:
        seen.popitem(last=False)
