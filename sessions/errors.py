"""Typed errors, and the one list of error codes.

`Code` is every code an `error` event can carry: the protocol's own (streamer.protocol), the
edge's (limits, auth, store), the engine's and the media path's. It lives here, in the lowest
layer, so the engine, the edge, the client SDK and the tests all use the same names;
docs/protocol.md documents each one (tests/streamer/test_codes.py holds the two together).
"""

from __future__ import annotations

from enum import Enum


class Code(str, Enum):
    """Error codes on the wire (`error.code`)."""

    # the protocol: a frame or a field the server refuses before any work
    INVALID_JSON = "invalid_json"
    INVALID_UTF8 = "invalid_utf8"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_TYPE = "unknown_type"
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    INVALID_FIELD = "invalid_field"
    MESSAGE_TOO_LARGE = "message_too_large"
    TEXT_TOO_LONG = "text_too_long"
    QUESTION_TOO_LONG = "question_too_long"
    SYSTEM_PROMPT_TOO_LONG = "system_prompt_too_long"
    PATTERN_TOO_LONG = "pattern_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    UNEXPECTED_BINARY = "unexpected_binary"
    # the edge: limits, access, the store
    RATE_LIMITED = "rate_limited"
    BYTE_RATE_LIMITED = "byte_rate_limited"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    SLOW_CONSUMER = "slow_consumer"
    IDLE_TIMEOUT = "idle_timeout"
    SHUTTING_DOWN = "shutting_down"
    SESSION_NOT_FOUND = "session_not_found"
    MOVED = "moved"
    STORE_UNAVAILABLE = "store_unavailable"
    REPLAY_FAILED = "replay_failed"
    DRAINING = "draining"
    # media
    MEDIA_HEADER_INVALID = "media_header_invalid"
    UNSUPPORTED_MEDIA = "unsupported_media"
    MEDIA_DECODE_ERROR = "media_decode_error"
    MEDIA_TOO_LARGE = "media_too_large"
    MEDIA_ERROR = "media_error"
    # the engine
    SESSION_CLOSED = "session_closed"
    CONTEXT_OVERFLOW = "context_overflow"
    INPUT_ENDED = "input_ended"
    QUERY_NOT_FOUND = "query_not_found"
    TOO_MANY_SESSIONS = "too_many_sessions"
    KV_BUDGET_EXCEEDED = "kv_budget_exceeded"
    FLASH_LIMIT = "flash_limit"
    FLASH_DUPLICATE = "flash_duplicate"
    FLASH_NOT_FOUND = "flash_not_found"
    RULE_NOT_FOUND = "rule_not_found"
    RULE_LIMIT = "rule_limit"
    INVALID_ROBOT_STATE = "invalid_robot_state"
    INTERNAL_ERROR = "internal_error"
    ENGINE_STOPPED = "engine_stopped"

    def __str__(self) -> str:
        return self.value


class EngineError(Exception):
    """An error a client caused or can act on; `recoverable` says if the session still works.
    `code` is a `Code` (a string naming one is accepted; anything else is a bug: ValueError)."""

    code: Code = Code.INTERNAL_ERROR
    param: str | None = None

    def __init__(self, message: str, *, code: Code | str | None = None, recoverable: bool = True,
                 param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = Code(code)
        self.recoverable = recoverable
        self.param = param  # the request field at fault, when there is one (sent as error.param)

    @property
    def message(self) -> str:
        return str(self)


class SessionNotFound(EngineError):
    code = Code.SESSION_NOT_FOUND


class SessionClosed(EngineError):
    code = Code.SESSION_CLOSED


class ContextOverflow(EngineError):
    code = Code.CONTEXT_OVERFLOW


class InputEnded(EngineError):
    code = Code.INPUT_ENDED


class InvalidRequest(EngineError):
    code = Code.INVALID_FIELD


class EngineStopped(EngineError):
    code = Code.ENGINE_STOPPED

    def __init__(self, message: str = "the engine is shutting down") -> None:
        super().__init__(message, recoverable=False)
