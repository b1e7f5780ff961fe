"""The JavaScript SDK (/sdk/streamer.js) in a real headless Chromium: it is served, it reaches
every command docs/protocol.md lists, and after a real server restart (SIGKILL, then a new
process on the same port and file store) it resumes its session and resends exactly what the
server lacks: every input is in the log once, in order."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from browserutil import Chromium, media_flags, sdk_feed
from fakemedia import write_y4m
from procutil import ServerProcess
from wsutil import serve

from streamer.store import FileStore
from streamer.web import FILES

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "streamer" / "web" / "streamer.js"


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One browser for the module, with a fake camera."""
    video = write_y4m(tmp_path_factory.mktemp("media") / "camera.y4m", seconds=4.0, fps=10, scene_s=0.5)
    browser = Chromium(*media_flags(video)).start()
    yield browser
    browser.stop()


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers, response.read()


def documented_commands() -> set[str]:
    """The first column of the "Client -> server" table of docs/protocol.md."""
    doc = (ROOT / "docs" / "protocol.md").read_text()
    table = doc.split("## Client -> server", 1)[1].split("\n## ", 1)[0]
    types = set()
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith(("| type", "|---")):
            continue
        first = line.split("|")[1].strip()
        types.add(first.strip("`") if first.startswith("`") else "media" if first == "binary media frame" else first)
    return types


def sdk_commands() -> dict[str, str]:
    block = SDK.read_text().split("export const COMMANDS = Object.freeze({", 1)[1].split("});", 1)[0]
    return dict(re.findall(r'"([a-z.]+)": "(\w+\.\w+)"', block))


def test_sdk_and_page_files_are_served(tiny_engine):
    async def run(url, server):
        base = url.replace("ws://", "http://")
        for path, (_, kind) in FILES.items():
            status, headers, body = await asyncio.to_thread(http_get, base + path)
            assert status == 200 and headers["Content-Type"] == kind and body, path
            text = body.decode()
            assert "http://" not in text and "https://" not in text, f"{path} names an external resource"
            if path.startswith("/sdk/"):  # importable from pages served elsewhere
                assert headers["Access-Control-Allow-Origin"] == "*"
            else:
                assert "default-src 'self'" in headers["Content-Security-Policy"]
        for path in ("/sdk/nope.js", "/app/../server.py", "/app/app.html"):
            with pytest.raises(urllib.error.HTTPError) as info:
                await asyncio.to_thread(http_get, base + path)
            assert info.value.code == 404, path

    serve(tiny_engine, run)


def test_every_documented_command_has_an_sdk_method():
    documented, sdk = documented_commands(), sdk_commands()
    assert len(documented) >= 20 and "session.resume" in documented and "media" in documented
    assert set(sdk) == documented, (set(sdk) ^ documented)
    source = SDK.read_text()
    classes = dict(re.findall(r"\nexport class (\w+)[^{]*\{(.*?)\n\}", source, re.DOTALL))
    for kind, target in sdk.items():
        cls, method = target.split(".")
        assert re.search(rf"\n  (?:async |static async )?{method}\(", classes[cls]), f"{target} ({kind}) is missing"
        if kind != "media":  # the media frame is binary: no type field
            assert f'type: "{kind}"' in source, kind


EXERCISE = """(async () => {
  const m = await import("/sdk/streamer.js");
  const c = await m.StreamerClient.connect(URL_);
  const errors = [];
  const attempt = async (f) => { try { return await f(); } catch (e) { errors.push(e.code); } };
  const flashEvents = [];
  const s = await c.createSession({ systemPrompt: "Be brief.", flash: [{ question: "Who?", max_tokens: 3 }] });
  await s.append("Ada keeps the light. ");
  await s.revise("Ada Morrow keeps the light. ");
  await s.update({ thinking: { mode: "off" } });
  await s.get();
  const deltas = [];
  for await (const ev of s.ask("Who keeps it?", { max_tokens: 4 })) deltas.push(ev.type);
  const long = s.ask("Tell me everything.", { max_tokens: 60 });
  long.cancel();
  const cancelled = await long.done;
  const f = await s.registerFlash("What is kept?", { max_tokens: 3 }, (ev) => flashEvents.push(ev.type));
  const rule = await attempt(() => s.addRule({ flashId: f.flash_id, pattern: "light", command: { go: 1 } }));
  await attempt(() => s.removeRule(rule.rule_id));
  await attempt(() => s.startActions({ dt_ms: 100, horizon: 5 }));
  s.robotState([0, 0]);
  await attempt(() => s.stopActions());
  await s.unregisterFlash(f.flash_id);
  s.sendMedia({ kind: "image", format: "png" }, new Uint8Array([137, 80, 78, 71]));  // refused: not a picture
  const watch = await c.subscribe(s.id, s.tokens.subscriber);
  await watch.unsubscribe();
  await attempt(() => c.listSessions());
  await s.end();
  const c2 = await m.StreamerClient.connect(URL_);
  const s2 = await c2.resumeSession(s.id, s.tokens.producer);
  const closed = await s2.close();
  const sent = { ...c.stats.sent };
  for (const [k, v] of Object.entries(c2.stats.sent)) sent[k] = (sent[k] ?? 0) + v;
  return JSON.stringify({ sent, errors, deltas, cancelled: cancelled.finish_reason, inputs: closed.inputs });
})()"""


def test_the_sdk_sends_every_documented_command(chromium, tiny_engine):
    async def run(url, server):
        async with chromium.page() as page:
            await page.navigate(url.replace("ws://", "http://") + "/sdk/streamer.js")  # a same-origin document
            out = json.loads(await page.eval(EXERCISE.replace("URL_", json.dumps(url + "/"))))
        assert documented_commands() <= set(out["sent"]), documented_commands() - set(out["sent"])
        assert out["errors"] == [], out["errors"]
        assert out["deltas"][-1] == "query.done" and out["cancelled"] in ("cancelled", "length", "stop")
        assert out["inputs"] == 1  # the revise replaced the append

    serve(tiny_engine, run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def test_the_sdk_resends_what_a_restarted_server_lacks(chromium, tmp_path):
    n, port, store = 80, free_port(), tmp_path / "store"
    args = ("--model", "tiny", "--store", str(store), "--port", str(port), "--no-media")

    async def run():
        first = await asyncio.to_thread(ServerProcess, *args)
        second = None
        try:
            async with chromium.page() as page:
                await page.navigate(first.url.replace("ws://", "http://") + "/sdk/streamer.js")
                sid = await page.eval(sdk_feed(first.url + "/", n))
                await page.wait_for("window.t.acks >= 10", 60)
                await asyncio.to_thread(first.kill)  # SIGKILL with inputs in flight
                await page.wait_for("!window.t.client.connected", 30)
                second = await asyncio.to_thread(ServerProcess, *args)
                assert second.url == first.url
                await page.wait_for("window.t.done", 180)
                results = await page.eval("window.t.results")
                resumed = await page.eval("window.t.resumed")
                unacked = await page.eval("window.t.session.unacked.size")
                sent = await page.eval("window.t.client.stats.sent['input.text.append'] - window.t.sentBeforeClose")
        finally:
            first.stop()
            if second is not None:
                second.stop()
        return sid, results, resumed, unacked, sent

    sid, results, resumed, unacked, sent = asyncio.run(run())
    print(f"resumed at client_seq {resumed['last_client_seq']} of {n} ({resumed['replayed_records']} records "
          f"replayed); resent {sent}; {results.count('duplicate')} acknowledged by the resume")
    assert all(r in ("ack", "duplicate") for r in results), results
    assert unacked == 0
    assert resumed["replayed_records"] >= 1 and resumed["last_client_seq"] < n  # some were resent after it
    assert sent == n - resumed["last_client_seq"]  # after the resume: exactly what the log lacked
    records = asyncio.run(FileStore(store).read_log(sid))
    appends = [r["text"] for r in records if r["kind"] == "append"]
    assert appends == [f"piece {i}. " for i in range(n)]  # every input exactly once, in order
    assert [r["client_seq"] for r in records if r["kind"] == "append"] == list(range(1, n + 1))


RECORD = """(async () => {
  const stream = await navigator.mediaDevices.getUserMedia({ video: { width: 160, height: 120, frameRate: 10 } });
  window.pieces = [];
  const recorder = new MediaRecorder(stream, { mimeType: "video/webm;codecs=vp8" });
  recorder.ondataavailable = async (ev) => {
    const bytes = new Uint8Array(await ev.data.arrayBuffer());
    let bin = "";
    for (const b of bytes) bin += String.fromCharCode(b);
    window.pieces.push(btoa(bin));
    if (window.pieces.length === 12) { recorder.stop(); stream.getTracks().forEach((t) => t.stop()); }
  };
  recorder.start(250);
})()"""


def test_browser_webm_pieces_decode_as_they_arrive(chromium, tiny_engine):
    """Chromium's MediaRecorder WebM states no frame rate; the decoder must not hold frames
    back to estimate one (it did: about 4 s of a live camera, then a burst)."""
    import base64

    pytest.importorskip("av")
    from streamer.vision.video import VideoDecoder

    async def run(url, server):
        async with chromium.page() as page:
            await page.navigate(url.replace("ws://", "http://") + "/sdk/streamer.js")
            await page.eval(RECORD)
            await page.wait_for("window.pieces.length >= 12", 60)
            return [base64.b64decode(p) for p in await page.eval("window.pieces")]

    pieces = serve(tiny_engine, run)
    decoder = VideoDecoder("webm", 0.0)
    per_piece = [len(decoder.feed(p)) for p in pieces]
    per_piece.append(len(decoder.finish()))
    assert sum(per_piece[:2]) > 0, per_piece  # frames come out with the first pieces, not seconds later
    assert sum(per_piece) >= 20, per_piece
