"""Typed media errors. Each is an EngineError, so the server reports its code as is and the
session (and everything it accepted before) survives."""

from __future__ import annotations

from streamer.sessions.errors import Code, EngineError


class MediaError(EngineError):
    """Media bytes that cannot be used; the session keeps working."""

    code = Code.MEDIA_ERROR


class MediaDecodeError(MediaError):
    """Corrupt or truncated container or codec bytes."""

    code = Code.MEDIA_DECODE_ERROR


class UnsupportedMedia(MediaError):
    """A kind, container or codec this server does not take (or whose extra is not installed)."""

    code = Code.UNSUPPORTED_MEDIA


class MediaTooLarge(MediaError):
    """A frame (or a decoded picture) beyond the configured limit."""

    code = Code.MEDIA_TOO_LARGE


class MediaHeaderInvalid(MediaError):
    """A binary frame whose header is missing, malformed, or does not match the stream."""

    code = Code.MEDIA_HEADER_INVALID
