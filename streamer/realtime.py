"""The OpenAI Realtime (GA) door: `/v1/realtime` on the same port, translated to our protocol.

`RealtimeProtocol` is sans I/O, as streamer.protocol is: a Realtime client event in, native
`Command`s (and any Realtime events to send at once) out; a native server event in, the Realtime
events it means out. The commands run through the same handlers, event log, media hub, limits
and backpressure as a native connection's (`RealtimeConnection` is a `Connection` whose frames
are parsed and whose events are written by the translator). docs/realtime.md maps each event.

What a Realtime session means here: every user item is input the session reads (`input_text`
appended, `input_image` a frame, committed PCM16 audio transcribed into the cache); a response is
a question over what the session has read, answered with streamed deltas and never added to the
session; an out-of-band response with `metadata` is a standing question (a flash question),
answered and pushed again whenever its answer changes. Audio output, tools, named conversations,
item deletion/truncation and server VAD are refused with an `error` naming what is unsupported.

Resumption: `session.created` carries the session id and a resume token
(`session.streamer.resume_query`); a connection to `/v1/realtime?session_id=ID&resume_token=TOKEN`
resumes that session (re-attached, or replayed from the store after a restart). Writes carrying an
`event_id` the session already took are answered again, not applied twice: on this server from
the layer's memory, after a restart from the session's log (its records carry the event ids:
streamer.records.note_event_ids; the newest MAX_LOGGED_EVENT_IDS outlive checkpoints).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs
from weakref import WeakKeyDictionary

from streamer.sessions.errors import Code

from .connection import Connection
from .eventlog import logged_event_ids
from .protocol import Command, ProtocolError, ProtocolLimits, ServerProtocol
from .records import Received

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
AUDIO_RATE = 24_000  # GA `audio/pcm`: 16-bit little-endian mono at 24 kHz
MAX_AUDIO_BUFFER = 15 << 20  # bytes of uncommitted audio (the GA limit)
DEFAULT_MAX_OUTPUT_TOKENS = 128
MAX_SEEN_EVENT_IDS = 4096  # per session: event ids remembered for deduplication
SERVER_ERRORS = frozenset({"internal_error", "store_unavailable", "shutting_down", "replay_failed", "engine_stopped",
                           "slow_consumer", "kv_budget_exceeded"})
UNSUPPORTED_EVENTS = {
    "conversation.item.delete": "deleting items (input is part of the session's data once read)",
    "conversation.item.truncate": "truncating items (audio output is not supported)",
    "conversation.item.retrieve": "retrieving items",
    "output_audio_buffer.clear": "audio output",
}
HANDLED = ("session.update", "conversation.item.create", "input_audio_buffer.append", "input_audio_buffer.commit",
           "input_audio_buffer.clear", "response.create", "response.cancel")


def is_realtime(path: str | None) -> bool:
    """Whether a websocket request path opens the Realtime door."""
    return path is not None and path.split("?", 1)[0].rstrip("/") == REALTIME_PATH


class Refused(Exception):
    """A Realtime event this server refuses: an `error` with a Code, a message and the param."""

    def __init__(self, code: Code, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass(slots=True)
class RealtimeSession:
    """The Realtime layer's state of one session on this server, shared by the connections that
    produce into it one after another (a reconnect finds it again)."""

    session_id: str
    instructions: str | None = None  # prefixed to every question (the cache's system prompt is fixed)
    max_output_tokens: int | None = None
    truncation: Any = "auto"
    window_max: int | None = None  # the window the session has now (truncation with a ratio keeps its size)
    client_seq: int = 0  # the client_seq of the last text input (the native dedupe number)
    media_seq: int = 0  # one increasing seq for the session's image and audio frames
    audio_start: float | None = None
    audio_samples: int = 0
    items: int = 0
    responses: int = 0
    # in response ids: a new process counts responses from 1 again, so its ids differ by this
    epoch: str = field(default_factory=lambda: secrets.token_hex(3))
    last_item_id: str | None = None
    last_user_text: str | None = None
    last_audio_item: str | None = None
    audio: bytearray = field(default_factory=bytearray)
    # event_id -> its item (dict), the _Item while pending, "standing", or what the log says (Logged)
    seen: OrderedDict = field(default_factory=OrderedDict)
    standing: dict[str, dict] = field(default_factory=dict)  # flash_id -> {"metadata", "max_tokens"}
    image_duplicates: int = 0

    def next_response_ids(self) -> tuple[str, str]:
        """A new response's id and its output item's id."""
        self.responses += 1
        return (f"resp_{self.session_id}_{self.epoch}_{self.responses}",
                f"item_{self.session_id}_{self.epoch}_r{self.responses}")


# Realtime state per server (its Services object) and session: outlives connections, not the process.
SESSIONS: WeakKeyDictionary[Any, dict[str, RealtimeSession]] = WeakKeyDictionary()


@dataclass(slots=True)
class Logged:
    """What the session's log says an event id made (a session resumed after a restart): the
    item and how many of its text parts are in, `done` when all of it is, or a standing question."""

    item_id: str | None = None
    texts: int = 0
    done: bool = False
    flash_id: str | None = None


@dataclass(slots=True)
class _Item:
    """A user item on its way into the session: done when each native part is in."""

    item: dict
    event_id: str | None
    parts: int
    failed: bool = False
    echoes: int = 0  # duplicates (same event_id) that arrived while it was pending


@dataclass(slots=True)
class _Response:
    id: str
    item_id: str
    metadata: dict | None
    conversation: str | None  # "conv_<sid>" or None (out of band)
    max_output_tokens: int
    event_id: str | None = None
    query_id: str | None = None
    text: list[str] = field(default_factory=list)
    flash_id: str | None = None


class RealtimeProtocol(ServerProtocol):
    """One Realtime connection's translation state (sans I/O)."""

    def __init__(self, limits: ProtocolLimits, sessions: dict[str, RealtimeSession], model: str,
                 max_answer_tokens: int, count_tokens: Callable[[str], int] | None = None,
                 logged: Callable[[str], dict] | None = None) -> None:
        super().__init__(limits)
        self.sessions, self.model, self.max_answer_tokens = sessions, model, max_answer_tokens
        self.count_tokens = count_tokens
        self.logged = logged  # session id -> the event ids its log holds (eventlog.logged_event_ids)
        self.received: list[tuple[str, str]] = []  # (event id, item id) of media items in: to log
        self.rt: RealtimeSession | None = None
        self.fatal: tuple[str, str] | None = None  # the session could not be opened: close with this
        self.opened = False
        self._ids = itertools.count(1)
        self.out = RealtimeEvents(self)
        self.pending: dict[str, Any] = {}  # native event_id (ours) -> _Item | _Response | "open" | "update"
        self.media: dict[int, _Item] = {}  # media seq -> its item
        self.images: list[_Item] = []  # image items waiting for their observation, in order
        self.running: dict[str, _Response] = {}  # response id -> running question

    # ---- opening --------------------------------------------------------------------------

    def open_command(self, query: str) -> Command:
        """`session.create`, or `session.resume` when the URL names a session and its token."""
        params = {k: v[-1] for k, v in parse_qs(query).items()}
        sid, token = params.get("session_id"), params.get("resume_token")
        if sid and token:
            return self._native("session.resume", "open", session_id=sid, token=token)
        if sid or token:
            self.fatal = ("missing_field", "resuming needs both 'session_id' and 'resume_token' in the URL query")
        return self._native("session.create", "open")

    def _native(self, type: str, ctx: Any, **fields: Any) -> Command:
        """A native command, validated by the native schema (its limits and codes), with an
        event id of ours that maps its replies back to `ctx`."""
        eid = f"rt{next(self._ids)}"
        self.pending[eid] = ctx
        try:
            return self._command({"type": type, "event_id": eid, **fields})
        except ProtocolError as err:
            del self.pending[eid]
            raise Refused(err.code, err.message, err.param) from None

    # ---- inbound --------------------------------------------------------------------------

    def receive_text(self, data: str | bytes) -> Command:
        """One Realtime event as one batch command for the connection's receive loop: its
        `actions` (native commands and Realtime events, in order); `kind` set when it carries
        media, so the loop waits on a media stream that is behind."""
        actions = self.receive_realtime(data if isinstance(data, str) else bytes(data).decode("utf-8", "replace"))
        media = [a for a in actions if isinstance(a, Command) and a.type == "media"]
        sid = self.rt.session_id if self.rt is not None else None
        fields = {"actions": actions, **({"kind": media[-1]["kind"]} if media else {})}
        return Command("media" if media else "realtime", None, sid, fields)

    def receive_binary(self, data: bytes) -> Command:
        raise ProtocolError(Code.UNEXPECTED_BINARY, "binary frames are not part of the Realtime API: send audio as "
                            "input_audio_buffer.append (base64 PCM16, 24 kHz mono)")

    refuse_binary = receive_binary

    def receive_realtime(self, text: str) -> list[Command | str]:
        """One client event: the native commands to dispatch and Realtime events to send now
        (in order). Raises ProtocolError for frames that are not JSON objects."""
        msg = self._json(text)
        event_id = msg.get("event_id") if isinstance(msg.get("event_id"), str) else None
        kind = msg.get("type")
        try:
            if not isinstance(kind, str):
                raise Refused(Code.MISSING_FIELD, "event has no 'type'", "type")
            if kind in UNSUPPORTED_EVENTS:
                raise Refused(Code.UNKNOWN_TYPE, f"{kind} is not supported by this server: "
                              f"{UNSUPPORTED_EVENTS[kind]}", "type")
            if kind not in HANDLED:
                raise Refused(Code.UNKNOWN_TYPE, f"unknown or unsupported event type {kind[:60]!r}; supported: "
                              f"{', '.join(HANDLED)}", "type")
            return getattr(self, "_" + kind.replace(".", "_"))(msg, event_id)
        except Refused as err:
            return [self.out.rt_error(err.code, err.message, err.param, event_id)]

    def _json(self, text: str) -> dict:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_message_bytes:
            raise ProtocolError(Code.MESSAGE_TOO_LARGE, f"event of {size} bytes exceeds the limit of "
                                f"{self.limits.max_message_bytes} bytes")
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(Code.INVALID_JSON, f"event is not valid JSON: {exc}") from None
        if not isinstance(msg, dict):
            raise ProtocolError(Code.NOT_AN_OBJECT, "an event must be a JSON object")
        return msg

    def _session_update(self, msg: dict, event_id: str | None) -> list[Command | str]:
        rt, config = self.rt, _object(msg.get("session"), "session")
        _refuse_set(config, {"prompt": "stored prompts", "reasoning": "reasoning settings", "tracing": "traces",
                             "include": "extra output fields (logprobs)"}, "session")
        if config.get("type") not in (None, "realtime"):
            raise Refused(Code.INVALID_FIELD, "only 'realtime' sessions are supported (not transcription)",
                          "session.type")
        _check_text_output(config, "session")
        known = {"type", "model", "instructions", "output_modalities", "audio", "tools", "tool_choice",
                 "max_output_tokens", "truncation", "tracing", "include", "parallel_tool_calls", "prompt", "reasoning"}
        if unknown := sorted(set(config) - known):
            raise Refused(Code.UNKNOWN_FIELD, f"session has no field {unknown[0]!r}", f"session.{unknown[0]}")
        if "instructions" in config:
            if config["instructions"] is not None and not isinstance(config["instructions"], str):
                raise Refused(Code.INVALID_FIELD, "session.instructions must be a string", "session.instructions")
            rt.instructions = config["instructions"] or None
        if "max_output_tokens" in config:
            rt.max_output_tokens = self._max_tokens(config["max_output_tokens"], "session.max_output_tokens")
        if "truncation" in config and config["truncation"] != rt.truncation:
            window = _window(config["truncation"], rt.window_max)
            rt.truncation = config["truncation"]
            if window is not None:
                return [self._native("session.update", ("update", event_id), session_id=rt.session_id,
                                     window=window[0])]
        return [self.out.rt_event("session.updated", session=self.out.session_config(), reply=event_id)]

    def _max_tokens(self, value: Any, param: str) -> int | None:
        if value is None:
            return None
        if value == "inf":
            return self.max_answer_tokens
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise Refused(Code.INVALID_FIELD, f"{param} must be an integer in [1, 4096] or 'inf'", param)
        return min(value, self.max_answer_tokens)

    def _conversation_item_create(self, msg: dict, event_id: str | None) -> list[Command | str]:
        rt, item = self.rt, _object(msg.get("item"), "item")
        logged = rt.seen.get(event_id) if event_id is not None else None
        if not isinstance(logged, Logged) and (dup := self._duplicate(event_id)) is not None:
            return dup
        if item.get("type", "message") != "message":
            raise Refused(Code.INVALID_FIELD, f"items of type {str(item.get('type'))[:40]!r} are not supported "
                          "(tools and function calls are not supported); send messages", "item.type")
        if item.get("role") not in ("user", "system"):
            raise Refused(Code.INVALID_FIELD, "only user and system messages are input here (answers are "
                          "responses)", "item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise Refused(Code.MISSING_FIELD, "item.content must be a non-empty list", "item.content")
        if msg.get("previous_item_id") not in (None, rt.last_item_id) and not isinstance(logged, Logged):
            raise Refused(Code.INVALID_FIELD, "items are input in arrival order: previous_item_id must be the last "
                          "item or absent", "previous_item_id")
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise Refused(Code.INVALID_FIELD, f"item.content[{i}] must be an object", "item.content")
            parts.append(_part(part, i))
        if isinstance(logged, Logged) and not logged.flash_id:  # taken before a restart: what of it is in
            texts = sum(kind == "text" for kind, _ in parts)
            if logged.done or (texts == len(parts) and logged.texts >= texts):
                taken = rt.seen[event_id] = self._item(logged.item_id, item["role"], content,
                                                       logged.item_id is not None)
                return self.out.item_events(taken, event_id)
            skip = logged.texts  # its first text parts are in the session: the rest goes in
            parts = [p for i, p in enumerate(parts) if p[0] != "text" or sum(k == "text" for k, _ in parts[:i]) >= skip]
            item = {**item, "id": logged.item_id or item.get("id")}
        again = isinstance(logged, Logged) and not logged.flash_id and logged.item_id is not None
        entry = _Item(self._item(item.get("id"), item["role"], content, again), event_id, len(parts))
        out: list[Command | str] = []
        for kind, value in parts:
            out.append(self._input(entry, kind, value))
        self._remember(event_id, entry)
        return out

    def _input(self, entry: _Item, kind: str, value: Any) -> Command:
        rt = self.rt
        if kind == "text":
            rt.client_seq += 1
            if entry.item["role"] == "user":
                rt.last_user_text = value
            cmd = self._native("input.text.append", entry, session_id=rt.session_id, text=value,
                               client_seq=rt.client_seq)
            if entry.event_id is not None:  # its record carries the event: a resend after a restart is told
                cmd.fields["logged"] = {"event_id": entry.event_id, "item_id": entry.item["id"]}
            return cmd
        rt.media_seq += 1
        seq = rt.media_seq
        self.media[seq] = entry
        if kind == "image":
            fmt, data = value
            self.images.append(entry)
            return Command("media", None, rt.session_id, {"kind": "image", "format": fmt, "seq": seq,
                                                          "ts": time.time(), "live": False, "payload": data})
        rt.last_audio_item = entry.item["id"]
        if rt.audio_start is None:
            rt.audio_start = time.time()
        ts = rt.audio_start + rt.audio_samples / AUDIO_RATE
        rt.audio_samples += len(value) // 2
        return Command("media", None, rt.session_id, {"kind": "audio", "format": "pcm_s16le", "seq": seq, "ts": ts,
                                                      "sample_rate": AUDIO_RATE, "channels": 1, "end": True,
                                                      "payload": value})

    def _input_audio_buffer_append(self, msg: dict, event_id: str | None) -> list[Command | str]:
        data = _b64(msg.get("audio"), "audio")
        if len(self.rt.audio) + len(data) > MAX_AUDIO_BUFFER:
            raise Refused(Code.MEDIA_TOO_LARGE, f"the input audio buffer holds at most {MAX_AUDIO_BUFFER} bytes; "
                          "commit it first", "audio")
        self.rt.audio += data
        return []

    def _input_audio_buffer_commit(self, msg: dict, event_id: str | None) -> list[Command | str]:
        rt = self.rt
        logged = rt.seen.get(event_id) if event_id is not None else None
        if isinstance(logged, Logged) and logged.done:  # committed before a restart
            taken = rt.seen[event_id] = self._item(logged.item_id, "user", [{"type": "input_audio"}],
                                                   logged.item_id is not None)
            return self.out.item_events(taken, event_id)
        if (dup := self._duplicate(event_id)) is not None:
            return dup
        if len(rt.audio) < 2:
            raise Refused(Code.INVALID_FIELD, "the input audio buffer is empty: append PCM16 audio before committing",
                          "audio")
        data, rt.audio = bytes(rt.audio), bytearray()
        step = self.limits.max_media_bytes - self.limits.max_media_bytes % 2
        chunks = [data[i:i + step] for i in range(0, len(data), step)]
        entry = _Item(self._item(None, "user", [{"type": "input_audio"}]), event_id, len(chunks))
        previous = rt.last_item_id
        out: list[Command | str] = [self.out.rt_event("input_audio_buffer.committed", item_id=entry.item["id"],
                                                  previous_item_id=previous)]
        for i, chunk in enumerate(chunks):
            cmd = self._input(entry, "audio", chunk)
            cmd.fields["end"] = i == len(chunks) - 1
            out.append(cmd)
        self._remember(event_id, entry)
        return out

    def _input_audio_buffer_clear(self, msg: dict, event_id: str | None) -> list[Command | str]:
        self.rt.audio = bytearray()
        return [self.out.rt_event("input_audio_buffer.cleared")]

    def _response_create(self, msg: dict, event_id: str | None) -> list[Command | str]:
        rt, params = self.rt, _object(msg.get("response") or {}, "response")
        _refuse_set(params, {"prompt": "stored prompts", "reasoning": "reasoning settings"}, "response")
        _check_text_output(params, "response")
        known = {"conversation", "input", "instructions", "max_output_tokens", "metadata", "output_modalities",
                 "audio", "tools", "tool_choice", "prompt", "reasoning", "parallel_tool_calls"}
        if unknown := sorted(set(params) - known):
            raise Refused(Code.UNKNOWN_FIELD, f"response has no field {unknown[0]!r}", f"response.{unknown[0]}")
        conversation = params.get("conversation") or "auto"
        if conversation not in ("auto", "none"):
            raise Refused(Code.INVALID_FIELD, "named conversations are not supported: conversation is 'auto' or "
                          "'none'", "response.conversation")
        metadata = params.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
            raise Refused(Code.INVALID_FIELD, "response.metadata must map at most 16 keys to strings of at most 512 "
                          "characters", "response.metadata")
        question = self._question(params)
        if rt.instructions:
            question = f"{rt.instructions}\n\n{question}"
        limit = self._max_tokens(params.get("max_output_tokens"), "response.max_output_tokens")
        max_tokens = limit or rt.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS
        if conversation == "none" and metadata:  # a standing question: our flash questions
            if (dup := self._duplicate(event_id)) is not None:
                return dup
            self._remember(event_id, "standing")
            flash_id = _flash_id(metadata, next(self._ids))
            rt.standing[flash_id] = {"metadata": metadata, "max_tokens": max_tokens}
            cmd = self._native("flash.register", ("standing", flash_id, event_id), session_id=rt.session_id,
                               question=question, flash_id=flash_id, max_tokens=max_tokens)
            if event_id is not None:
                cmd.fields["logged"] = {"event_id": event_id}
            return [cmd]
        resp = _Response(*rt.next_response_ids(), metadata,
                         None if conversation == "none" else f"conv_{rt.session_id}", max_tokens, event_id)
        cmd = self._native("query.create", resp, session_id=rt.session_id, question=question, max_tokens=max_tokens,
                           query_id=resp.id[-64:])
        resp.query_id = cmd["query_id"]
        self.running[resp.id] = resp
        return [*self.out.opening(resp), cmd]

    def _question(self, params: dict) -> str:
        """A response's question: the text of its `input` messages, else its `instructions`, else
        the newest user text item of the session."""
        items = params.get("input")
        if items:
            texts = []
            for item in items if isinstance(items, list) else [None]:
                if not isinstance(item, dict) or item.get("type", "message") != "message":
                    raise Refused(Code.INVALID_FIELD, "response.input takes messages with input_text parts (item "
                                  "references and tool items are not supported)", "response.input")
                texts += [p.get("text") for p in item.get("content") or [] if isinstance(p, dict)
                          and p.get("type") in ("input_text", "text") and isinstance(p.get("text"), str)]
            if not texts:
                raise Refused(Code.MISSING_FIELD, "response.input has no input_text", "response.input")
            return "\n".join(texts)
        if isinstance(params.get("instructions"), str) and params["instructions"]:
            return params["instructions"]
        if self.rt.last_user_text:
            return self.rt.last_user_text
        raise Refused(Code.MISSING_FIELD, "response.create needs a question: response.input (a user message), "
                      "response.instructions, or a user text item before it", "response.input")

    def _response_cancel(self, msg: dict, event_id: str | None) -> list[Command | str]:
        rt, rid = self.rt, msg.get("response_id")
        for flash_id, standing in rt.standing.items():
            if rid is not None and (rid == flash_id or rid in standing.get("responses", ())):
                return [self._native("flash.unregister", ("unregister", flash_id, event_id), session_id=rt.session_id,
                                     flash_id=flash_id)]
        resp = self.running.get(rid) if rid else next(reversed(self.running.values()), None)
        if resp is None:
            raise Refused(Code.QUERY_NOT_FOUND, f"no response {rid!r} in progress" if rid else
                          "no response in progress", "response_id")
        return [self._native("query.cancel", ("cancel", event_id), session_id=rt.session_id, query_id=resp.query_id)]

    def _duplicate(self, event_id: str | None) -> list[str] | None:
        """A write whose event_id the session already took: its item again, not a second write."""
        if event_id is None or event_id not in self.rt.seen:
            return None
        item = self.rt.seen[event_id]
        if isinstance(item, Logged):  # from the log (a restart): a standing question is taken
            return [] if item.flash_id is not None else None
        if isinstance(item, _Item):  # still on its way: echoed when it is in
            item.echoes += 1
            return []
        return self.out.item_events(item, event_id) if isinstance(item, dict) else []  # a standing question: taken

    def _remember(self, event_id: str | None, entry: Any) -> None:
        if event_id is None:
            return
        seen = self.rt.seen
        seen[event_id] = entry
        while len(seen) > MAX_SEEN_EVENT_IDS:
            seen.popitem(last=False)

    def _item(self, item_id: Any, role: str, content: list, logged: bool = False) -> dict:
        """An item as answered; `logged`: one the log knows (a resend after a restart), not a new one."""
        rt = self.rt
        rt.items += not logged
        kept = [{k: v for k, v in p.items() if k not in ("audio", "image_url")} for p in content]
        return {"id": item_id if isinstance(item_id, str) and item_id else f"item_{rt.session_id}_{rt.items}",
                "object": "realtime.item", "type": "message", "role": role, "status": "completed", "content": kept}

class RealtimeEvents:
    """The outbound half of a Realtime connection's translation: native events -> Realtime events
    (sans I/O; the state is its `RealtimeProtocol`'s)."""

    def __init__(self, proto: "RealtimeProtocol") -> None:
        self.p = proto
        self._server_ids = itertools.count(1)

    def rt_event(self, type: str, reply: str | None = None, **fields: Any) -> str:
        """A Realtime server event (`reply` is not a wire field: GA events do not echo ids)."""
        body = {"type": type, "event_id": f"event_{next(self._server_ids)}"}
        body.update({k: v for k, v in fields.items() if v is not None})
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))

    def rt_error(self, code: str, message: str, param: str | None = None, event_id: str | None = None) -> str:
        code = getattr(code, "value", code)
        kind = "server_error" if code in SERVER_ERRORS else "invalid_request_error"
        return self.rt_event("error", error={"type": kind, "code": code, "message": message, "param": param,
                                             "event_id": event_id})

    def translate(self, text: str) -> list[str]:
        """One native event -> the Realtime events it means (none for what has no counterpart)."""
        ev = json.loads(text)
        if "ts" not in ev:  # already a Realtime event (native events are stamped with `ts`)
            return [text]
        kind, ctx = ev["type"], self.p.pending.pop(ev.get("reply_to"), None) if ev.get("reply_to") else None
        if kind == "query.delta":  # more deltas follow: the context stays
            self.p.pending[ev["reply_to"]] = ctx
            return self._delta(ctx, ev) if isinstance(ctx, _Response) else []
        if kind == "error":
            return self._error(ctx, ev)
        if isinstance(ctx, tuple) and ctx[0] == "update":
            self.p.rt.window_max = (ev["session"].get("window") or {}).get("max_tokens")
            return [self.rt_event("session.updated", session=self.session_config())]
        handler = getattr(self, "_on_" + kind.replace(".", "_"), None)
        return handler(ctx, ev) if handler is not None else []

    def _on_session_created(self, ctx: Any, ev: dict) -> list[str]:
        sid = ev["session_id"]
        self.p.rt = self.p.sessions.setdefault(sid, RealtimeSession(sid))
        self.p.rt.window_max = (ev["session"].get("window") or {}).get("max_tokens")
        self.p.opened = True
        token = ev["tokens"]["producer"]
        extra = {"session_id": sid, "resume_token": token, "resume_query": {"session_id": sid, "resume_token": token},
                 "tokens": ev["tokens"], "resumed": False}
        return [self.rt_event("session.created", session=self.session_config(extra))]

    def _on_session_resumed(self, ctx: Any, ev: dict) -> list[str]:
        sid, state = ev["session_id"], ev["session"]
        if sid not in self.p.sessions and self.p.logged is not None:  # new to this server: the log's event ids
            self.p.sessions[sid] = _remembered(sid, self.p.logged(sid))
        rt = self.p.rt = self.p.sessions.setdefault(sid, RealtimeSession(sid))
        rt.client_seq = max(rt.client_seq, ev.get("last_client_seq") or 0)
        rt.window_max = (state.get("window") or {}).get("max_tokens")
        for q in state.get("flash") or ():  # standing questions outlive the process: their metadata too
            rt.standing.setdefault(q["flash_id"], {"metadata": _metadata_of(q["flash_id"]), "max_tokens": None})
        self.p.opened = True
        extra = {"session_id": sid, "resumed": True, "replayed_records": ev.get("replayed_records"),
                 "data_version": state.get("data_version")}
        return [self.rt_event("session.created", session=self.session_config(extra))]

    def session_config(self, extra: dict | None = None) -> dict:
        rt = self.p.rt
        return {"type": "realtime", "object": "realtime.session", "id": rt.session_id, "model": self.p.model,
                "instructions": rt.instructions or "", "output_modalities": ["text"],
                "max_output_tokens": rt.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS, "truncation": rt.truncation,
                "tools": [], "tool_choice": "none",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": AUDIO_RATE}, "turn_detection": None}},
                "streamer": {"window_max_tokens": rt.window_max, **(extra or {})}}

    def _on_input_ack(self, ctx: Any, ev: dict) -> list[str]:
        if "media_seq" in ev:
            ctx = self.p.media.pop(ev["media_seq"], None)
            if ctx is None or ev.get("kind") != "image":
                return self._part_done(ctx)
            dups = (ev.get("media") or {}).get("duplicates", 0)
            if dups > self.p.rt.image_duplicates:  # a near-duplicate picture: no observation will follow
                self.p.rt.image_duplicates = dups
                self.p.images.remove(ctx)
                ctx.item["status"] = "incomplete"
                return self._part_done(ctx)
            return []  # done when its observation is in the cache
        return self._part_done(ctx)

    def _on_media_observation(self, ctx: Any, ev: dict) -> list[str]:
        if ev.get("kind", "image") == "image" and self.p.images:
            return self._part_done(self.p.images.pop(0))
        return []

    def _on_media_transcript(self, ctx: Any, ev: dict) -> list[str]:
        if not ev.get("final") or self.p.rt is None or self.p.rt.last_audio_item is None:
            return []
        usage = {"type": "duration", "seconds": round(float(ev.get("end_s", 0) or 0) - float(ev.get("start_s", 0) or 0),
                                                        3)}
        return [self.rt_event("conversation.item.input_audio_transcription.completed", item_id=self.p.rt.last_audio_item,
                              content_index=0, transcript=ev.get("text", ""), usage=usage)]

    def _part_done(self, ctx: Any) -> list[str]:
        if not isinstance(ctx, _Item) or ctx.failed:
            return []
        ctx.parts -= 1
        if ctx.parts > 0:
            return []
        rt = self.p.rt
        previous, rt.last_item_id = rt.last_item_id, ctx.item["id"]
        if ctx.event_id is not None and ctx.event_id in rt.seen:
            rt.seen[ctx.event_id] = ctx.item
            if any(p.get("type") != "input_text" and p.get("type") != "text" for p in ctx.item["content"]):
                self.p.received.append((ctx.event_id, ctx.item["id"]))  # the media path logs no event id
        out = self.item_events(ctx.item, None, previous)
        for _ in range(ctx.echoes):
            out += self.item_events(ctx.item, None, previous)
        return out

    def item_events(self, item: dict, event_id: str | None, previous: str | None = None) -> list[str]:
        return [self.rt_event("conversation.item.added", item={**item, "status": "in_progress"},
                              previous_item_id=previous),
                self.rt_event("conversation.item.done", item=item, previous_item_id=previous)]

    def opening(self, resp: _Response) -> list[str]:
        item = {"id": resp.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        return [self.rt_event("response.created", response=self._response(resp, "in_progress")),
                self.rt_event("response.output_item.added", response_id=resp.id, output_index=0, item=item),
                self.rt_event("response.content_part.added", response_id=resp.id, item_id=resp.item_id,
                              output_index=0, content_index=0, part={"type": "text", "text": ""})]

    def _response(self, resp: _Response, status: str, text: str | None = None, details: dict | None = None,
                  usage: dict | None = None, extra: dict | None = None) -> dict:
        output = [] if text is None else [{
            "id": resp.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
            "status": "completed" if status == "completed" else "incomplete",
            "content": [{"type": "output_text", "text": text}]}]
        body = {"id": resp.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "conversation_id": resp.conversation, "output_modalities": ["text"],
                "max_output_tokens": resp.max_output_tokens, "metadata": resp.metadata, "usage": usage}
        if extra:
            body["streamer"] = extra
        return body

    def _delta(self, resp: _Response, ev: dict) -> list[str]:
        resp.text.append(ev["delta"])
        return [self.rt_event("response.output_text.delta", response_id=resp.id, item_id=resp.item_id,
                              output_index=0, content_index=0, delta=ev["delta"])]

    def _closing(self, resp: _Response, text: str, status: str, details: dict | None, usage: dict | None,
                 extra: dict | None = None) -> list[str]:
        item = {"id": resp.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "completed" if status == "completed" else "incomplete",
                "content": [{"type": "output_text", "text": text}]}
        ids = {"response_id": resp.id, "item_id": resp.item_id, "output_index": 0, "content_index": 0}
        return [self.rt_event("response.output_text.done", text=text, **ids),
                self.rt_event("response.content_part.done", part={"type": "text", "text": text}, **ids),
                self.rt_event("response.output_item.done", response_id=resp.id, output_index=0, item=item),
                self.rt_event("response.done", response=self._response(resp, status, text, details, usage, extra))]

    def _on_query_done(self, resp: Any, ev: dict) -> list[str]:
        if not isinstance(resp, _Response):
            return []
        self.p.running.pop(resp.id, None)
        reason = ev.get("finish_reason")
        status, details = "completed", None
        if reason == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        elif reason in ("cancelled", "shutdown"):
            status, details = "cancelled", {"type": "cancelled", "reason": "client_cancelled"
                                            if reason == "cancelled" else None}
        read = ev.get("context_tokens", 0) + ev.get("question_tokens", 0)
        usage = {"total_tokens": read + ev.get("tokens", 0), "input_tokens": read, "output_tokens": ev.get("tokens", 0),
                 "input_token_details": {"text_tokens": read, "cached_tokens": ev.get("context_tokens", 0)},
                 "output_token_details": {"text_tokens": ev.get("tokens", 0)}}
        extra = {"data_version": ev.get("data_version"), "timing": ev.get("timing"), "cached": ev.get("cached", False)}
        return self._closing(resp, ev.get("text", "".join(resp.text)), status, details, usage, extra)

    def _on_flash_updated(self, ctx: Any, ev: dict) -> list[str]:
        """A standing question's answer changed (or its first answer): a whole response."""
        rt = self.p.rt
        standing = rt.standing.setdefault(ev["flash_id"], {"metadata": _metadata_of(ev["flash_id"]),
                                                           "max_tokens": None})
        resp = _Response(*rt.next_response_ids(),
                         standing["metadata"], None, standing["max_tokens"] or DEFAULT_MAX_OUTPUT_TOKENS,
                         flash_id=ev["flash_id"])
        standing.setdefault("responses", set()).add(resp.id)
        answer = ev.get("answer", "")
        tokens = self.p.count_tokens(answer) if self.p.count_tokens is not None else None
        usage = None if tokens is None else {"total_tokens": tokens, "input_tokens": 0, "output_tokens": tokens,
                                             "output_token_details": {"text_tokens": tokens}}
        extra = {"standing": True, "flash_id": ev["flash_id"], "data_version": ev.get("data_version"),
                 "confidence": ev.get("confidence"), "staleness_ms": ev.get("staleness_ms")}
        delta = self.rt_event("response.output_text.delta", response_id=resp.id, item_id=resp.item_id,
                              output_index=0, content_index=0, delta=answer)
        return [*self.opening(resp), delta, *self._closing(resp, answer, "completed", None, usage, extra)]

    def _on_flash_unregistered(self, ctx: Any, ev: dict) -> list[str]:
        standing = self.p.rt.standing.pop(ev["flash_id"], {})
        resp = _Response(ev["flash_id"], "", standing.get("metadata"), None, standing.get("max_tokens") or 0)
        return [self.rt_event("response.done", response=self._response(
            resp, "cancelled", None, {"type": "cancelled", "reason": "client_cancelled"}, None,
            {"standing": True, "flash_id": ev["flash_id"], "unregistered": True}))]

    def _error(self, ctx: Any, ev: dict) -> list[str]:
        err = ev["error"]
        if ctx is None and ev.get("media_seq") is not None:
            ctx = self.p.media.pop(ev["media_seq"], None)
        event_id = None
        if isinstance(ctx, _Item):
            ctx.failed = True
            event_id = ctx.event_id
            if ctx in self.p.images:
                self.p.images.remove(ctx)
            if ctx.event_id is not None and self.p.rt is not None:
                self.p.rt.seen.pop(ctx.event_id, None)  # refused: a resend is a new attempt
        elif isinstance(ctx, _Response):
            event_id = ctx.event_id
        elif isinstance(ctx, tuple):
            event_id = ctx[-1]
            if ctx[0] == "standing" and self.p.rt is not None:
                self.p.rt.standing.pop(ctx[1], None)
                self.p.rt.seen.pop(ctx[2], None) if ctx[2] else None
        elif ctx == "open":
            self.p.fatal = (err["code"], err["message"])
            return []
        out = [self.rt_error(err["code"], err["message"], err.get("param"), event_id)]
        if isinstance(ctx, _Response):
            self.p.running.pop(ctx.id, None)
            out.append(self.rt_event("response.done", response=self._response(
                ctx, "failed", None, {"type": "failed", "error": {"type": "invalid_request_error",
                                                                  "code": err["code"], "message": err["message"]}})))
        return out


class _WireErrors:
    """What the outbox writes when it drops a client, in Realtime's `error` shape."""

    def __init__(self, proto: RealtimeProtocol) -> None:
        self.proto = proto

    def error(self, code: str, message: str, **_: Any) -> str:
        return self.proto.out.rt_error(code, message)


class RealtimeConnection(Connection):
    """A `Connection` that speaks Realtime: its session is created (or resumed, from the URL) on
    connect, frames go through `RealtimeProtocol`, and every event it sends is translated. The
    limits, the shutdown check and the ordering barrier are the native receive loop's: one
    Realtime event reaches it as one batch command (`actions`), unpacked by `dispatch`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        engine = self.svc.engine
        tokenizer = getattr(engine.runner, "tokenizer", None)
        count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer is not None else None
        self.proto = self.peer.proto = RealtimeProtocol(
            self.config.protocol, SESSIONS.setdefault(self.svc, {}), engine.runner.name,
            getattr(getattr(engine, "limits", None), "max_answer_tokens", 1024), count,
            lambda sid: logged_event_ids(self.svc.events, sid))
        self.outbox.proto = _WireErrors(self.proto)
        self.peer.send = self.send
        self.opened: asyncio.Future[bool] = self.loop.create_future()

    def send(self, text: str) -> None:
        proto: RealtimeProtocol = self.proto
        for out in proto.out.translate(text):
            self.outbox.send(out)
        while proto.received and proto.rt is not None:  # an image or audio item is in: its event id is logged
            event_id, item_id = proto.received.pop(0)
            record = Received(event_id=event_id, item_id=item_id)
            self.svc.events.first(proto.rt.session_id, record, lambda r=record: r.apply(None, ""))
        if proto.fatal is not None and self.outbox.dropping is None:
            self.outbox.drop(proto.fatal[0], proto.fatal[1], close_code=1008)
        if (proto.opened or proto.fatal is not None) and not self.opened.done():
            self.opened.set_result(proto.opened)

    async def run(self) -> None:
        path = self.ws.request.path if self.ws.request is not None else ""
        self.dispatch(self.proto.open_command(path.partition("?")[2]))
        await super().run()

    async def receive(self, frame) -> None:
        if isinstance(frame, str) and not await self.opened:
            return  # the session could not be opened: the connection is closing
        await super().receive(frame)

    def dispatch(self, cmd: Command) -> None:
        if "actions" not in cmd.fields:
            super().dispatch(cmd)
            return
        for action in cmd["actions"]:
            if isinstance(action, str):
                self.outbox.send(action)
            elif action.type == "media" and self.peer.media is None:
                self.proto.media.pop(action["seq"], None)
                self.send(self.proto.error(Code.UNEXPECTED_BINARY, "media input (images, audio) is not enabled on "
                                           "this server"))
            else:
                super().dispatch(action)


def _remembered(sid: str, logged: dict) -> RealtimeSession:
    """A session's Realtime state after a restart: the event ids its log holds (and the item
    numbers they used, so new items do not take them again)."""
    rt = RealtimeSession(sid)
    for event_id, entry in logged.items():
        rt.seen[event_id] = Logged(**{k: v for k, v in entry.items() if k in Logged.__slots__})
        number = str(entry.get("item_id") or "").removeprefix(f"item_{sid}_")
        if number.isdigit():
            rt.items = max(rt.items, int(number))
    return rt


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise Refused(Code.INVALID_FIELD, f"{name} must be an object", name)
    return value


def _refuse_set(config: dict, fields: dict[str, str], where: str) -> None:
    for name, what in fields.items():
        if config.get(name) not in (None, {}, []):
            raise Refused(Code.INVALID_FIELD, f"{where}.{name}: {what} are not supported by this server", f"{where}.{name}")


def _check_text_output(config: dict, where: str) -> None:
    """Text out only: audio output, tools and server VAD are refused, never ignored."""
    modalities = config.get("output_modalities")
    if modalities is not None and modalities != ["text"]:
        raise Refused(Code.INVALID_FIELD, f"{where}.output_modalities: only ['text'] is supported (no audio output)",
                      f"{where}.output_modalities")
    if config.get("tools"):
        raise Refused(Code.INVALID_FIELD, f"{where}.tools: tools are not supported by this server", f"{where}.tools")
    if config.get("tool_choice") not in (None, "none", "auto"):
        raise Refused(Code.INVALID_FIELD, f"{where}.tool_choice: tools are not supported by this server",
                      f"{where}.tool_choice")
    audio = config.get("audio")
    if audio is None:
        return
    if not isinstance(audio, dict):
        raise Refused(Code.INVALID_FIELD, f"{where}.audio must be an object", f"{where}.audio")
    if audio.get("output"):
        raise Refused(Code.INVALID_FIELD, f"{where}.audio.output: audio output is not supported (text only)",
                      f"{where}.audio.output")
    audio_in = audio.get("input") or {}
    fmt = audio_in.get("format") or {}
    if fmt and (fmt.get("type") not in (None, "audio/pcm") or fmt.get("rate") not in (None, AUDIO_RATE)):
        raise Refused(Code.UNSUPPORTED_MEDIA, f"{where}.audio.input.format: only audio/pcm at 24000 Hz is supported",
                      f"{where}.audio.input.format")
    if audio_in.get("turn_detection") is not None:
        raise Refused(Code.INVALID_FIELD, f"{where}.audio.input.turn_detection: server VAD is not supported; set it "
                      "to null and commit the buffer yourself", f"{where}.audio.input.turn_detection")
    if audio_in.get("noise_reduction") is not None:
        raise Refused(Code.INVALID_FIELD, f"{where}.audio.input.noise_reduction is not supported",
                      f"{where}.audio.input.noise_reduction")


def _b64(data: Any, param: str) -> bytes:
    if not isinstance(data, str):
        raise Refused(Code.INVALID_FIELD, f"{param} must be a base64 string", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise Refused(Code.INVALID_FIELD, f"{param} is not valid base64", param) from None
    if not raw:
        raise Refused(Code.INVALID_FIELD, f"{param} is empty", param)
    return raw


def _flash_id(metadata: dict, n: int) -> str:
    """A standing question's flash id: its metadata itself when it fits (so it outlives a
    restart with the session's log), else a number."""
    compact = "rt" + json.dumps(metadata, ensure_ascii=True, separators=(",", ":"), sort_keys=True)
    return compact if len(compact) <= 64 and compact.isprintable() else f"rt#{n}"


def _metadata_of(flash_id: str) -> dict:
    if flash_id.startswith("rt{"):
        try:
            return json.loads(flash_id[2:])
        except ValueError:
            pass
    return {"flash_id": flash_id}


def _part(part: dict, i: int) -> tuple[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "text"):
        if not isinstance(part.get("text"), str) or not part["text"]:
            raise Refused(Code.MISSING_FIELD, f"item.content[{i}] needs a non-empty 'text'", "item.content")
        return "text", part["text"]
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:image/"):
            raise Refused(Code.INVALID_FIELD, f"item.content[{i}].image_url must be a data: URI (data:image/png"
                          ";base64,... or image/jpeg); remote URLs are not fetched", "item.content")
        head, _, data = url.partition(",")
        fmt = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}.get(head[5:].split(";")[0])
        if fmt is None or ";base64" not in head:
            raise Refused(Code.UNSUPPORTED_MEDIA, f"item.content[{i}]: only base64 PNG and JPEG images are "
                          "supported", "item.content")
        return "image", (fmt, _b64(data, "item.content"))
    if kind == "input_audio":
        return "audio", _b64(part.get("audio") or "", "item.content")
    raise Refused(Code.INVALID_FIELD, f"item.content[{i}].type {str(kind)[:40]!r} is not supported (input_text, "
                  "input_image, input_audio)", "item.content")


def _window(truncation: Any, window_max: int | None) -> tuple[dict | None] | None:
    """The native window a `truncation` means (in a 1-tuple; None: leave the window)."""
    if truncation == "auto":
        return None  # the session keeps the window it has (the default one unless changed)
    if truncation == "disabled":
        return (None,)  # unbounded: input past the model's window is refused (context_overflow)
    config = _object(truncation, "session.truncation")
    ratio = config.get("retention_ratio")
    if config.get("type") != "retention_ratio" or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise Refused(Code.INVALID_FIELD, "session.truncation must be 'auto', 'disabled' or {type: "
                      "'retention_ratio', retention_ratio: (0, 1]}", "session.truncation")
    limit = (config.get("token_limits") or {}).get("post_instructions") or window_max
    if not isinstance(limit, int) or limit < 1:
        raise Refused(Code.INVALID_FIELD, "session.truncation.token_limits.post_instructions must be a positive "
                      "integer (the session has no window to keep)", "session.truncation")
    return ({"max_tokens": limit, "keep_tokens": max(1, int(limit * ratio))},)
