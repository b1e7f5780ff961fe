"""Real `streamer serve` processes for crash and failover tests."""

import os
import re
import signal
import subprocess
import sys
import threading


class ServerProcess:
    """`python -m streamer serve --port 0 ...`; `url` once it prints where it listens."""

    def __init__(self, *args: str, ready_timeout: float = 300.0) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "streamer", "serve", "--port", "0", "--threads", "1",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        ready = threading.Event()
        self.url = None

        def read() -> None:
            for line in self.proc.stdout:
                self.output.append(line)
                match = re.search(r"streamer listening on (ws://\S+)", line)
                if match and self.url is None:
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(ready_timeout) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.output[-40:]))

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, nothing."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
