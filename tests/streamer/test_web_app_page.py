"""The /app page as a new user meets it, in a real headless Chromium against a real server
(no media extras needed): an API key typed after a refused "New session" works without a
reload and the banner says what to do in the page; flash answers get a readable column; the
camera stops once the server refuses media; numbers carry units; the tab icon is served; a
question asked while the session lags is answered over what it has read (where the server
takes `over`)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest
from browserutil import Browser, click, el, fill, media_flags
from fakemedia import write_y4m
from wsutil import serve

from streamer.auth import ApiKeys
from streamer.protocol import SCHEMAS

KEY = "page-key-" + "p" * 16
APP = "streamerApp"


@pytest.fixture(scope="module")
def page_engine(tokenizer):
    """A tiny seeded model with the default answer limit (the page asks for up to 96 tokens)."""
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=11)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name), EngineLimits(max_context_tokens=2048)).start()
    yield engine
    engine.stop()


async def open_app(page, url: str, width: int = 1280, height: int = 800) -> None:
    await page.viewport(width, height)
    await page.navigate(url.replace("ws://", "http://") + "/app")
    await page.eval("localStorage.clear(); sessionStorage.clear()")


async def new_session(page) -> str:
    await click(page, "create")
    return await page.wait_for(f"{el('sid')}.length > 8 && {el('sid')}", 60)


def banner() -> str:
    return f"!{el('error', 'hidden')} && {el('error')}"


def test_key_typed_after_a_refused_new_session_works_without_reload(page_engine):
    """No key, "New session": refused, and the banner tells a browser user to type the key in
    the page (one code, no 'Authorization: Bearer' header they cannot send). Then the key, and
    "New session" again: a session, on the same page."""

    async def run(url, server):
        async with Browser() as page:
            await open_app(page, url)
            await new_session_refused(page)
            await fill(page, "api-key", KEY)
            sid = await new_session(page)
            assert sid in server.directory.sessions
            assert await page.eval(el("error", "hidden"))  # the old banner went with the new try

    async def new_session_refused(page):
        await click(page, "create")
        text = await page.wait_for(banner(), 60)
        assert text.count("unauthorized") == 1, text
        assert "API key field" in text and "/app?api_key=" in text, text
        assert "Bearer" not in text and "Authorization" not in text, text
        assert not await page.eval(el("create", "disabled"))

    serve(page_engine, run, api_keys=ApiKeys({"web": KEY}))


# Eight words: in a readable answer column this takes a line or two, not eight.
LONG_ANSWER = "The keeper of the lighthouse is Ada Morrow"

MEASURE_ANSWER = """(() => {
    const td = document.querySelector('#flash-rows tr td.answer');
    td.textContent = %s;  // layout only: the cell as it lays out this text (the next tick redraws it)
    const range = document.createRange();
    range.selectNodeContents(td);
    const tops = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
    const table = document.querySelector('table.flash').getBoundingClientRect();
    return {lines: tops.size, width: td.getBoundingClientRect().width, table: table.width,
            scroll: document.documentElement.scrollWidth, inner: window.innerWidth};
})()""" % json.dumps(LONG_ANSWER)


def test_flash_answers_get_a_readable_column(page_engine):
    """At 1280x800 (three columns) the answer of a flash question spans the flash panel, so an
    eight-word answer takes at most two lines (it used to take one line a word); at a phone
    width it still fits without sideways scrolling."""

    async def run(url, server):
        async with Browser() as page:
            await open_app(page, url)
            await new_session(page)
            await fill(page, "flash-question", "Who keeps the lighthouse?")
            await click(page, "register")
            await page.wait_for("document.querySelector('#flash-rows tr td.answer') !== null", 60)
            desktop = await page.eval(MEASURE_ANSWER)
            assert desktop["width"] >= 0.6 * desktop["table"], desktop
            assert desktop["lines"] <= 2, desktop
            await page.screenshot("app-flash-1280x800.png")
            await page.viewport(390, 844, mobile=True)
            await page.wait_for("window.innerWidth === 390", 10)
            phone = await page.eval(MEASURE_ANSWER)
            assert phone["lines"] <= 3 and phone["scroll"] <= phone["inner"], phone
            await page.screenshot("app-flash-390.png", full_page=True)

    serve(page_engine, run)


def test_camera_stops_when_the_server_takes_no_media(page_engine, tmp_path):
    """A server started without media input (`--no-media`) refuses every binary frame with
    `unexpected_binary`: the camera stops (tracks ended, recorder inactive), nothing more is
    uploaded, and the banner says why in the page's words."""
    video = write_y4m(tmp_path / "camera.y4m", seconds=2.0, fps=10, scene_s=0.5)

    async def run(url, server):
        async with Browser(*media_flags(video)) as page:
            await open_app(page, url)
            await new_session(page)
            # The click makes the camera before it starts (and before any refusal can come).
            await page.eval(f"document.getElementById('camera').click(); window.cam = {APP}.camera")
            assert await page.eval("cam !== null")
            text = await page.wait_for(banner(), 60)
            assert "unexpected_binary" in text and "stopped" in text, text
            assert text.count("unexpected_binary") == 1, text
            state = await page.eval("({tracks: cam.stream.getTracks().map((t) => t.readyState), "
                                    "recorder: cam.recorder ? cam.recorder.state : 'none', app: !!streamerApp.camera, "
                                    f"disabled: {el('camera', 'disabled')}, "
                                    "sent: streamerApp.client.stats.mediaBytes.video})")
            assert state["tracks"] and all(t == "ended" for t in state["tracks"]), state
            assert state["recorder"] in ("inactive", "none") and not state["app"] and state["disabled"], state
            assert state["sent"] > 0  # it did try
            # Three page ticks (a second each) and a text round trip later, not one byte more
            # (a recording camera sends a piece every 100 ms).
            ticks = await page.eval(f"{APP}.ticks ?? 0")
            await page.wait_for(f"{APP}.ticks >= {ticks + 3}", 30)
            await fill(page, "text-input", "still here")
            await click(page, "send-text")
            await page.wait_for(f"{el('text-note')}.includes('in the cache')", 60)
            assert await page.eval(f"{APP}.client.stats.mediaBytes.video") == state["sent"]
            assert await page.eval(f"{APP}.client.connected")

    serve(page_engine, run, media=None)


UNITS = re.compile(r"^\d+ ms|^\d+(\.\d)? s|^\d+ min")


def test_numbers_carry_units(page_engine):
    """Durations in ms / s / min with no stray decimals, sizes in B / KiB / MiB, token counts
    with thousands separators: the lag card read "12.34 ms (text)"."""

    async def run(url, server):
        async with Browser() as page:
            await open_app(page, url)
            await new_session(page)
            await fill(page, "text-input", "The lighthouse keeper is Ada Morrow.")
            await click(page, "send-text")
            await page.wait_for(f"{el('text-note')}.includes('in the cache')", 60)
            lag = await page.wait_for(f"{el('lag')} !== '–' && {el('lag')}", 30)
            assert UNITS.match(lag) and lag.endswith("(text)"), lag
            assert re.fullmatch(r"[\d,]+ tok", await page.eval(el("tokens")))
            rate = await page.wait_for(f"{el('rate')} !== '–' && {el('rate')}", 30)
            assert re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB)/s", rate), rate

    serve(page_engine, run)


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers, response.read()


def test_favicon_is_served(page_engine):
    """/favicon.ico (asked for by browsers on their own) and the pages' <link rel="icon">: an
    SVG from the server itself, which the browser decodes; no 404."""

    async def run(url, server):
        base = url.replace("ws://", "http://")
        for path in ("/favicon.ico", "/favicon.svg"):
            status, headers, body = await asyncio.to_thread(http_get, base + path)
            assert status == 200 and headers["Content-Type"] == "image/svg+xml" and body.startswith(b"<svg"), path
        async with Browser() as page:
            for path in ("/app", "/dashboard"):
                await page.navigate(base + path)
                icon = await page.eval("""new Promise((resolve) => {
                    const link = document.querySelector('link[rel=icon]');
                    const img = new Image();
                    img.onload = () => resolve({href: link.href, width: img.naturalWidth});
                    img.onerror = () => resolve({href: link.href, width: 0});
                    img.src = link.href;
                })""")
                assert icon["href"] == base + "/favicon.svg" and icon["width"] > 0, (path, icon)
                status = await page.eval("fetch('/favicon.ico').then((r) => r.status)")
                assert status == 200, path

    serve(page_engine, run)


def test_a_lagging_session_is_asked_over_what_it_has_read(page_engine):
    """A question asked while inputs are not yet acknowledged goes with `over: "read"`: where
    the server takes it, the answer says how much it covers ("answered over N inputs; M still
    being read"); a server without it refuses the field (unknown_field) and the page asks again
    without it, so the answer still comes. Not lagging: no `over`."""
    server_takes_over = "over" in SCHEMAS["query.create"]

    async def run(url, server):
        async with Browser() as page:
            await open_app(page, url)
            await new_session(page)
            await fill(page, "text-input", "The lighthouse keeper is Ada Morrow.")
            await click(page, "send-text")
            await page.wait_for(f"{el('text-note')}.includes('in the cache')", 60)
            # Every input acknowledged: asked over everything sent unless the last ingest lag was
            # over 2 s (the page's rule, decided at the click from what the page knew then).
            await fill(page, "question", "Who is the keeper?")
            decided = await page.eval(f"""(() => {{
                const lagging = {APP}.session.unacked.size > 0 || ({APP}.lagMs ?? 0) > 2000;
                document.getElementById('ask').click();
                return [lagging, {APP}.lastAsk];
            }})()""")
            assert decided in ([False, "sent"], [True, "read"]), decided
            meta = await page.wait_for("document.querySelector('#answers li .a:not(.streaming)') && "
                                       "document.querySelector('#answers li .note').textContent", 60)
            assert "data_version" in meta, meta
            before = await page.eval(f"{APP}.client.stats.sent['query.create']")
            # Lagging: an input still unacknowledged when the question goes (both in one turn
            # of the page's event loop, so the ack cannot come in between).
            asked = await page.eval(f"""(() => {{
                const known = {APP}.overRead;  // false: this server already refused `over`
                {APP}.session.append('She has kept it since 1998.\\n');
                {el('question', 'value')} = 'Since when?';
                document.getElementById('ask').click();
                return [known, {APP}.lastAsk];
            }})()""")
            assert asked[1] == "read" or (asked == [False, "sent"] and not server_takes_over), asked
            meta = await page.wait_for("document.querySelectorAll('#answers li .a:not(.streaming)').length === 2 && "
                                       "document.querySelector('#answers li .note').textContent", 60)
            sent = await page.eval(f"{APP}.client.stats.sent['query.create']") - before
            if server_takes_over:
                assert re.search(r"answered over \d+ inputs; \d+ still being read", meta), meta
                assert sent == 1
            else:  # refused once (unknown_field), asked again without it
                assert "data_version" in meta and "answered over" not in meta, meta
                assert sent == (2 if asked[1] == "read" else 1) and await page.eval(f"{APP}.overRead") is False

    serve(page_engine, run)


def test_a_repeated_note_is_taken_off_the_reasoning_panel(tokenizer):
    """Dual thinking on the parrot (every note it writes is the same): the server drops the
    repeats (reasoning.done `repeated`), and the page takes their streamed text back off its
    reasoning panel, so it shows the one kept note, as later answers read it."""
    from parrot import parrot_runner

    from streamer.sessions.engine import Engine, EngineLimits

    engine = Engine(parrot_runner(tokenizer), EngineLimits(max_context_tokens=2048)).start()

    async def run(url, server):
        async with Browser() as page:
            await open_app(page, url)
            await page.eval(f"{el('thinking', 'checked')} = true")
            sid = await new_session(page)
            # counted after the page's own handler has run (listeners run in the order they were added)
            await page.eval(f"window.dones = 0; window.lastSeq = 0; {APP}.session.on('reasoning.done', "
                            "(ev) => { window.dones += 1; window.lastSeq = ev.seq_range[1]; })")
            for row in ("row 1: temp=20.1C", "row 2: temp=20.3C", "row 3: temp=87.5C"):
                await fill(page, "text-input", row)
                await click(page, "send-text")
                await page.wait_for(f"{el('text-note')}.includes('in the cache')", 60)
            # the note over the last row is the last one (rows that arrive while a note is written
            # are read by the next one: 2 or 3 notes)
            await page.wait_for("window.lastSeq >= 3", 120)
            state = await asyncio.wrap_future(server.engine.session_state(sid))
            thinking = state["thinking"]
            assert thinking["units"] == 1 and thinking["repeated_units"] >= 1, thinking
            assert await page.eval("window.dones") == thinking["units"] + thinking["repeated_units"]
            kept = state["thinking"]["recent"][0]["text"]
            shown = await page.eval(el("reasoning"))
            assert shown.split() == kept.split(), (shown, kept)

    try:
        serve(engine, run)
    finally:
        engine.stop()
