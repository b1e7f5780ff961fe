"""A real headless Chromium for tests, driven over the DevTools protocol with the websockets
package (no Playwright, no Puppeteer: nothing to download).

Chromium is a system package (Debian `chromium`; `.ci/run` installs it when missing). A test
that needs it fails when it is missing, locally and in CI alike: a browser test that skips
itself is a test nobody runs.

Fake media devices: `--use-fake-device-for-media-stream --use-fake-ui-for-media-stream` grant
getUserMedia without a prompt; `--use-file-for-fake-video-capture=FILE.y4m` and
`--use-file-for-fake-audio-capture=FILE.wav` make the camera and the microphone play those
files, looped (see fakemedia.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from helpers import until
from websockets.asyncio.client import connect

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
BASE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-extensions", "--mute-audio", "--autoplay-policy=no-user-gesture-required",
              "--disable-background-timer-throttling", "--disable-renderer-backgrounding"]


class ChromiumMissing(RuntimeError):
    pass


def chromium_path() -> str:
    """The Chromium binary; raises ChromiumMissing (tests fail, they do not skip) without it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise ChromiumMissing("the browser tests need Chromium: apt-get install chromium (.ci/run installs it)")
    return path


def media_flags(video: Path | None = None, audio: Path | None = None) -> list[str]:
    flags = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]
    if video is not None:
        flags.append(f"--use-file-for-fake-video-capture={video}")
    if audio is not None:
        flags.append(f"--use-file-for-fake-audio-capture={audio}")
    return flags


def _http_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


class Page:
    """One page target: commands by id, events kept (console lines and uncaught exceptions
    are collected so a failing assertion can show what the page said)."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.events: asyncio.Queue[dict] = asyncio.Queue()
        self.console: list[str] = []
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg:
                fut = self.waiting.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            method = msg.get("method")
            if method == "Runtime.consoleAPICalled":
                args = msg["params"]["args"]
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif method == "Runtime.exceptionThrown":
                details = msg["params"]["exceptionDetails"]
                self.console.append("exception: " + details.get("exception", {}).get("description", details["text"]))
            self.events.put_nowait(msg)

    async def call(self, method: str, timeout: float = 120.0, **params):
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = fut
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, timeout)
        if "error" in msg:
            raise AssertionError(f"{method}: {msg['error']}\npage console:\n" + self.log())
        return msg["result"]

    async def eval(self, expression: str, gesture: bool = True):
        """Evaluate in the page (promises awaited; `gesture`: as if the user clicked, so media
        and audio may start); returns the value, raises with the page's console on an exception."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True,
                                 userGesture=gesture)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} threw {result['exceptionDetails']}\npage console:\n" + self.log())
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 120.0, want=True):
        """Poll until the expression is truthy (or equals `want` when it is not True); returns it."""
        seen = [None]

        async def holds():
            seen[0] = await self.eval(expression, gesture=False)
            return (want is True and seen[0]) or (want is not True and seen[0] == want)

        try:
            await until(holds, timeout, expression)
        except AssertionError:
            raise AssertionError(f"{expression} is {seen[0]!r} after {timeout:g} s\npage console:\n" + self.log()) from None
        return seen[0]

    async def navigate(self, url: str) -> None:
        await self._load(self.call("Page.navigate", url=url))

    async def reload(self) -> None:
        await self._load(self.call("Page.reload", ignoreCache=True))

    async def _load(self, command) -> None:
        while not self.events.empty():
            self.events.get_nowait()
        await command
        while (await asyncio.wait_for(self.events.get(), 60)).get("method") != "Page.loadEventFired":
            pass

    async def viewport(self, width: int, height: int, mobile: bool = False) -> None:
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=mobile)

    async def screenshot(self, name: str, full_page: bool = False) -> Path:
        params = {}
        if full_page:  # the whole page at the viewport's width, not just what is on screen
            size = (await self.call("Page.getLayoutMetrics"))["cssContentSize"]
            params = {"captureBeyondViewport": True,
                      "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}
        shot = await self.call("Page.captureScreenshot", format="png", **params)
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def log(self) -> str:
        return "\n".join(self.console[-40:]) or "(nothing)"


class Chromium:
    """A headless Chromium process with one page target; start() and stop() are synchronous so a
    module-scoped fixture can share one browser between tests (each test opens the page with
    `async with chromium.page() as page:` on its own event loop)."""

    def __init__(self, *flags: str, size: tuple[int, int] = (1280, 800)) -> None:
        self.flags = [*BASE_FLAGS, f"--window-size={size[0]},{size[1]}", *flags]
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Chromium:
        self.proc = subprocess.Popen([chromium_path(), *self.flags, "--remote-debugging-port=0",
                                      f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.profile, ignore_errors=True)

    def page(self) -> _PageContext:
        return _PageContext(self)

    async def page_url(self) -> str:
        port_file = Path(self.profile) / "DevToolsActivePort"

        async def page_target():
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            if not (port_file.exists() and port_file.read_text().strip()):
                return None
            port = int(port_file.read_text().split()[0])
            targets = await asyncio.to_thread(_http_json, f"http://127.0.0.1:{port}/json/list")
            pages = [t for t in targets if t["type"] == "page"]
            return pages[0]["webSocketDebuggerUrl"] if pages else None

        return await until(page_target, 60, "a DevTools page target in Chromium")


class _PageContext:
    def __init__(self, chromium: Chromium) -> None:
        self.chromium = chromium
        self.page: Page | None = None

    async def __aenter__(self) -> Page:
        ws = await connect(await self.chromium.page_url(), max_size=None)
        self.page = Page(ws)
        for domain in ("Runtime", "Page"):
            await self.page.call(f"{domain}.enable")
        return self.page

    async def __aexit__(self, *exc) -> None:
        self.page.reader.cancel()
        await self.page.ws.close()


class Browser:
    """`async with Browser(flags) as page:` a headless Chromium with one page, for one test."""

    def __init__(self, *flags: str, size: tuple[int, int] = (1280, 800)) -> None:
        self.chromium = Chromium(*flags, size=size)
        self.context: _PageContext | None = None

    async def __aenter__(self) -> Page:
        self.chromium.start()
        try:
            self.context = self.chromium.page()
            return await self.context.__aenter__()
        except BaseException:
            self.chromium.stop()
            raise

    async def __aexit__(self, *exc) -> None:
        try:
            await self.context.__aexit__(*exc)
        finally:
            self.chromium.stop()


# Page helpers for the /app tests: an element's property (as a JS expression), typing, clicking.
def el(id_: str, prop: str = "textContent") -> str:
    return f"document.getElementById({json.dumps(id_)}).{prop}"


async def fill(page, id_: str, value: str) -> None:
    await page.eval(f"{el(id_, 'value')} = {json.dumps(value)}")


async def click(page, id_: str) -> None:
    await page.eval(f"document.getElementById({json.dumps(id_)}).click()")


def sdk_feed(url: str, n: int, session: str | None = None) -> str:
    """A page script for a page served by streamer: the SDK connects to `url` (a short reconnect
    backoff; `session`: the id a cluster's proxy routes on, which the new session takes), creates
    a session and appends `n` pieces ("piece i. ") 25 ms apart, a steady producer. `window.t`
    holds the client, the session, the acks so far, the `resumed` event, the appends sent before
    the first close, and once done the results (ack, duplicate or error <code> each). The script
    evaluates to the session id."""
    options = {"minBackoffMs": 100, "maxBackoffMs": 400, **({"session": session} if session else {})}
    return """(async () => {
  const m = await import("/sdk/streamer.js");
  const c = await m.StreamerClient.connect(URL_, OPTIONS_);
  const s = await c.createSession();
  const t = window.t = { client: c, session: s, acks: 0, done: false, resumed: null, results: null };
  c.on("resumed", (ev) => { t.resumed = ev.event; });
  c.on("close", () => { t.sentBeforeClose ??= c.stats.sent["input.text.append"]; });
  (async () => {
    const acks = [];
    for (let i = 0; i < N_; i++) {
      acks.push(s.append(`piece ${i}. `).then((ack) => { t.acks += 1; return ack; }));
      await new Promise((resolve) => setTimeout(resolve, 25));  // a steady producer
    }
    const settled = await Promise.allSettled(acks);
    t.results = settled.map((r) => r.status === "fulfilled" ? (r.value.duplicate ? "duplicate" : "ack")
                                                           : "error " + r.reason.code);
    t.done = true;
  })();
  return s.id;
})()""".replace("URL_", json.dumps(url)).replace("OPTIONS_", json.dumps(options)).replace("N_", str(n))
