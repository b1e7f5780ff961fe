"""The dashboard: served on the service's port, read-only, live. A headless Chromium (Debian
package `chromium`) loads it and is driven over the DevTools protocol; the screenshot is saved
under tests/artifacts/ (git-ignored)."""

import asyncio
import base64
import json
import shutil
import tempfile
import urllib.request
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from helpers import until
from wsutil import check_error, raw, serve

from streamer.auth import ApiKeys

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "k" * 24


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers, response.read()


def test_dashboard_files_are_served(tiny_engine):
    async def run(url, server):
        base = url.replace("ws://", "http://")
        for path, kind in (("/dashboard", "text/html"), ("/dashboard/app.js", "text/javascript"),
                           ("/dashboard/style.css", "text/css")):
            status, headers, body = await asyncio.to_thread(http_get, base + path)
            assert status == 200 and headers["Content-Type"].startswith(kind) and body
        with pytest.raises(urllib.error.HTTPError) as info:
            await asyncio.to_thread(http_get, base + "/dashboard/../auth.py")
        assert info.value.code == 404
        status, _, page = await asyncio.to_thread(http_get, base + "/dashboard")
        assert b"http://" not in page.replace(b"http://www.w3.org", b"") and b"https://" not in page  # no CDN

    serve(tiny_engine, run)


def test_read_only_tokens_and_operator_credential(tiny_engine):
    """A dashboard or subscriber token reads its own session only and cannot write; the
    sessions list and token-less watching need an API key."""

    async def run(url, server):
        owner = await raw(url, api_key=KEY)
        a = await owner.request({"type": "session.create"})
        b = await owner.request({"type": "session.create"})
        sid_a, sid_b = a["session_id"], b["session_id"]
        viewer = await raw(url)  # no API key: only tokens
        for role in ("dashboard", "subscriber"):
            token = a["tokens"][role]
            check_error(await viewer.request({"type": "subscribe", "session_id": sid_b, "token": token}),
                        "session_not_found")  # another session: as if it did not exist
            check_error(await viewer.request({"type": "session.resume", "session_id": sid_a, "token": token}),
                        "session_not_found")  # cannot become the producer
        sub = await viewer.request({"type": "subscribe", "session_id": sid_a, "token": a["tokens"]["dashboard"]})
        assert sub["type"] == "subscribed"
        for msg in ({"type": "input.text.append", "text": "x", "client_seq": 1},
                    {"type": "input.text.revise", "text": "x"}, {"type": "flash.register", "question": "q?"},
                    {"type": "session.close"}, {"type": "input.end"}):
            check_error(await viewer.request({**msg, "session_id": sid_a}), "forbidden")
        check_error(await viewer.request({"type": "sessions.list"}), "unauthorized")
        check_error(await viewer.request({"type": "subscribe", "session_id": sid_b}), "unauthorized")
        state = (await owner.request({"type": "session.get", "session_id": sid_a}))["session"]
        assert state["inputs"] == 0  # nothing got through
        operator = await raw(url, api_key=KEY)
        assert (await operator.request({"type": "subscribe", "session_id": sid_b}))["type"] == "subscribed"
        listed = await operator.request({"type": "sessions.list"})
        assert listed["type"] == "sessions"

    serve(tiny_engine, run, api_keys=ApiKeys({"ops": KEY}))


async def devtools_page(chromium_dir: str):
    """The websocket URL of the page target of a Chromium started with a debugging port."""
    port_file = Path(chromium_dir) / "DevToolsActivePort"
    await until(lambda: port_file.exists() and port_file.read_text().strip(), 30, "Chromium's DevTools port")
    port = int(port_file.read_text().split()[0])

    async def page():
        _, _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/json/list")
        pages = [t for t in json.loads(body) if t["type"] == "page"]
        return pages[0]["webSocketDebuggerUrl"] if pages else None

    return await until(page, 10, "a page target in Chromium")


class DevTools:
    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method, **params):
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expression):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression, want, timeout=60):
        seen = []

        async def matches():
            seen[:] = [await self.eval(expression)]
            return seen[0] == want

        try:
            await until(matches, timeout, f"{expression} to be {want!r}")
        except AssertionError:
            raise AssertionError(f"{expression} is {seen[0]!r}, expected {want!r}") from None
        return want


@pytest.mark.embedded
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (apt-get install chromium)")
def test_chromium_shows_a_live_session(embedded):
    from streamer.sessions.engine import Engine
    from streamer.sessions.runner import ModelRunner

    engine = Engine(ModelRunner(embedded.model, embedded.tokenizer, embedded.name)).start()

    async def run(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "system_prompt": "Answer in a few words.",
                                      "flash": [{"question": "Which boat is this log about?", "max_tokens": 8}],
                                      "thinking": {"mode": "dual", "unit_tokens": 8, "final_tokens": 0}})
        sid = created["session_id"]
        for text in ("Log of the fishing boat Dora, skipper Ana Reyes. ",
                     "06:10 left Porto Velho; wind light from the east. "):
            assert (await peer.request({"type": "input.text.append", "session_id": sid, "text": text}))["type"] == "input.ack"
        started = await peer.request({"type": "action.start", "session_id": sid, "dt_ms": 100, "horizon": 5})
        assert started["type"] == "action.started", started
        page_url = (url.replace("ws://", "http://") + f"/dashboard?session={sid}&token={created['tokens']['dashboard']}")
        profile = tempfile.mkdtemp(prefix="chromium-")
        browser = await asyncio.create_subprocess_exec(
            CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
            "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1280,1000", page_url,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with connect(await devtools_page(profile), max_size=None) as ws:
                tools = DevTools(ws)
                await tools.call("Runtime.enable")
                await tools.wait_for("document.getElementById('conn').textContent", "live")
                # the session list (keys are off: open) and the live view of this session
                await tools.wait_for(f"!!document.querySelector('tr.session[data-session-id=\"{sid}\"]')", True)
                await peer.send({"type": "robot.state", "session_id": sid, "state": [0.0, 0.0]})
                state = await flash_current(peer, sid, 2)
                answer = state["answer"]
                assert answer.strip()
                await tools.wait_for("document.querySelector('#flash tr[data-flash-id=\"f1\"] .answer')"
                                     "?.textContent", answer)
                await tools.wait_for("document.getElementById('version').textContent", "2")
                # live: new input shows up without a reload
                await peer.request({"type": "input.text.append", "session_id": sid,
                                    "text": '{"target": [1.0, 0.5]}'})  # an observation for the policy
                state = await flash_current(peer, sid, 3)
                await tools.wait_for("document.getElementById('version').textContent", "3")
                await tools.wait_for("document.querySelector('#flash tr[data-flash-id=\"f1\"] .answer')"
                                     "?.textContent", state["answer"])
                assert await tools.eval("document.querySelectorAll('#chart circle').length") >= 1
                # the reasoning stream and the action timeline
                await tools.wait_for("document.getElementById('reasoning').textContent.trim().length > 0", True)
                await tools.wait_for("document.querySelectorAll('#actions li').length > 0", True)
                await tools.wait_for("Number(document.getElementById('action-seq').textContent) > 0", True)
                lag = await tools.eval("document.getElementById('lag').textContent")
                assert lag.endswith(" ms"), lag
                shot = await tools.call("Page.captureScreenshot", format="png")
                ARTIFACTS.mkdir(exist_ok=True)
                path = ARTIFACTS / "dashboard.png"
                path.write_bytes(base64.b64decode(shot["data"]))
                print(f"dashboard screenshot: {path}")
                assert path.stat().st_size > 10_000
        finally:
            browser.kill()
            await browser.wait()
            shutil.rmtree(profile, ignore_errors=True)

    try:
        serve(engine, run, snapshot_interval_s=0.1)
    finally:
        engine.stop()


async def flash_current(peer, sid, version):
    async def caught_up():
        q = (await peer.request({"type": "session.get", "session_id": sid}))["session"]["flash"][0]
        return q if q.get("data_version", -1) >= version else None

    return await until(caught_up, 120, f"the flash answer of data_version {version}")

