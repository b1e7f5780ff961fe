"""A real server on its own thread and event loop, for tests whose clients are other processes
(the CLI, documentation snippets) or blocking code."""

from __future__ import annotations

import asyncio
import threading

from streamer.server import ServerConfig, StreamerServer


class ThreadedServer:
    """`StreamerServer(engine, ServerConfig(port=0, **config))` served from a daemon thread."""

    def __init__(self, engine, **config) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.server: StreamerServer | None = None
        ready = threading.Event()
        failed: list[Exception] = []

        async def start() -> None:
            try:
                self.server = await StreamerServer(engine, ServerConfig(port=0, **config)).start()
            except Exception as exc:  # handed to the test thread
                failed.append(exc)
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.create_task(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="test-server", daemon=True)
        self.thread.start()
        if not ready.wait(60) or failed:
            raise RuntimeError(f"server did not start: {failed}")
        self.url = f"ws://127.0.0.1:{self.server.port}"
        self.port = self.server.port

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
