"""Typed engine errors. Each carries a stable code that the wire protocol reports as is."""

from __future__ import annotations


class EngineError(Exception):
    """An error a client caused or can act on; `recoverable` says if the session still works."""

    code = "engine_error"
    param: str | None = None

    def __init__(self, message: str, *, code: str | None = None, recoverable: bool = True,
                 param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.recoverable = recoverable
        self.param = param  # the request field at fault, when there is one (sent as error.param)

    @property
    def message(self) -> str:
        return str(self)


class SessionNotFound(EngineError):
    code = "session_not_found"


class SessionClosed(EngineError):
    code = "session_closed"


class ContextOverflow(EngineError):
    code = "context_overflow"


class InputEnded(EngineError):
    code = "input_ended"


class InvalidRequest(EngineError):
    code = "invalid_field"


class EngineStopped(EngineError):
    code = "engine_stopped"

    def __init__(self, message: str = "the engine is shutting down") -> None:
        super().__init__(message, recoverable=False)
