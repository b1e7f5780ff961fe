"""One connection's outbound events: an ordered queue with byte watermarks, its writer task and
the slow-consumer watchdog.

Events are counted in bytes. Above `outbox_high_bytes` the connection stops reading its client
(`paused` turns true) until the queue is below `outbox_low_bytes`, so a client that does not read
is slowed down instead of growing memory; above the high mark for `slow_consumer_s`, or above
`outbox_max_bytes` at any time, it is dropped: the queue is freed, the client gets one
`slow_consumer` error and the connection closes with 1008. The slow-consumer check is a timer
armed when the queue passes the high mark, not a periodic poll: a connection that keeps up
costs the event loop nothing between its events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, ws, proto, config, on_pressure: Callable[[], None], on_drop: Callable[[str], None]) -> None:
        self.ws = ws
        self.proto = proto
        self.config = config  # ServerConfig: outbox_high_bytes, outbox_low_bytes, outbox_max_bytes, slow_consumer_s
        self.on_pressure = on_pressure  # the backpressure state may have changed
        self.on_drop = on_drop  # (code) the client is being dropped
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.bytes = 0
        self.congested_since: float | None = None  # above the high watermark since
        self.dropping: tuple[str, str, int] | None = None  # (code, message, close code) once dropped
        self.slow_timer: asyncio.TimerHandle | None = None  # armed while above the high watermark

    @property
    def congested(self) -> bool:
        """Whether reading the client should pause for its undelivered events."""
        if self.congested_since is not None and self.bytes <= self.config.outbox_low_bytes:
            self.congested_since = None
        return self.congested_since is not None

    def send(self, text: str) -> None:
        if self.dropping is not None:
            return
        cfg = self.config
        size = len(text)
        if self.bytes + size > cfg.outbox_max_bytes:
            self.drop("slow_consumer", f"more than {cfg.outbox_max_bytes} bytes of events undelivered")
            return
        self.bytes += size
        self.queue.put_nowait(text)
        if self.bytes > cfg.outbox_high_bytes and self.congested_since is None:
            self.congested_since = time.monotonic()
            if self.slow_timer is None:
                self.slow_timer = asyncio.get_running_loop().call_later(cfg.slow_consumer_s, self.check_slow)
            self.on_pressure()

    def drop(self, code: str, message: str, close_code: int = 1008) -> None:
        """Stop serving this client: free its queue, tell it why, close."""
        if self.dropping is not None:
            return
        log.warning("dropping a connection: %s (%s)", code, message)
        self.on_drop(code)
        self.dropping = (code, message, close_code)
        self.stop_timer()
        while not self.queue.empty():
            self.queue.get_nowait()
        self.bytes = 0
        self.queue.put_nowait(None)

    async def writer(self) -> None:
        """Send the queued events in order; after a drop, the reason, then close."""
        while (text := await self.queue.get()) is not None:
            await self.ws.send(text)
            self.bytes = max(0, self.bytes - len(text))
            if self.congested_since is not None:
                self.on_pressure()
        code, message, close_code = self.dropping
        error = self.proto.error(code, message, recoverable=False)
        try:  # the peer may not be reading: bounded waits, then cut the connection
            await asyncio.wait_for(self.ws.send(error), 1.0)
            await asyncio.wait_for(self.ws.close(close_code, message[:120]), 2.0)
        except (asyncio.TimeoutError, ConnectionClosed):
            pass
        if self.ws.transport is not None and self.ws.state is not State.CLOSED:
            self.ws.transport.abort()  # no close handshake came back (or the peer never stops sending)

    def check_slow(self) -> None:
        """The slow-consumer timer: drop the client if its queue stayed above the high mark for
        `slow_consumer_s`; while it is above the mark again since later, check again then."""
        self.slow_timer = None
        if self.dropping is not None or not self.congested:
            return
        cfg = self.config
        left = self.congested_since + cfg.slow_consumer_s - time.monotonic()
        if left > 0:
            self.slow_timer = asyncio.get_running_loop().call_later(left, self.check_slow)
            return
        self.drop("slow_consumer", f"events undelivered above {cfg.outbox_high_bytes} bytes for more "
                  f"than {cfg.slow_consumer_s:g} s")

    def stop_timer(self) -> None:
        if self.slow_timer is not None:
            self.slow_timer.cancel()
            self.slow_timer = None
