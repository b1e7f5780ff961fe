"""The dashboard: served on the service's port, read-only, live. A headless Chromium (Debian
package `chromium`) loads it and is driven over the DevTools protocol; the screenshot is saved
under tests/artifacts/ (git-ignored)."""

import asyncio
import json
import re
import shutil
import tempfile
import urllib.error
import urllib.request

import pytest
from browserutil import BASE_FLAGS, Browser, chromium_path
from helpers import get_json, until
from wsutil import check_error, raw, serve

from streamer.auth import ApiKeys

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

    serve(tiny_engine, run, api_keys=ApiKeys({"ops": KEY}, {"ops": "operator"}))





def test_first_paint_json_needs_a_token_or_a_key(tiny_engine):
    """/dashboard/session.json and /dashboard/sessions.json (the page's first paint) read what
    the websocket would let the same credential read, and refuse the rest the same way."""

    async def run(url, server):
        base = url.replace("ws://", "http://")
        owner = await raw(url, api_key=KEY)
        created = await owner.request({"type": "session.create", "flash": [{"question": "Who?", "max_tokens": 2}]})
        sid = created["session_id"]
        await append(owner, sid, "Ada keeps the light. ")
        get = lambda path: asyncio.to_thread(get_json, base + path)  # noqa: E731
        for role in ("dashboard", "subscriber", "producer"):
            status, body = await get(f"/dashboard/session.json?session={sid}&token={created['tokens'][role]}")
            assert status == 200 and body["session"]["data_version"] == 1, body
            assert body["snapshot"]["session_id"] == sid and body["snapshot"]["last_seq"] == 1
            assert "ingest_lag_ms" in body["snapshot"] and body["snapshot"]["flash"][0]["flash_id"] == "f1"
        status, body = await get(f"/dashboard/session.json?session={sid}&api_key={KEY}")
        assert status == 200 and body["snapshot"]["session_id"] == sid
        for path, want, code in ((f"/dashboard/session.json?session={sid}&token=wrong-token", 404, "session_not_found"),
                                 (f"/dashboard/session.json?session=nope&token={created['tokens']['dashboard']}", 404,
                                  "session_not_found"),
                                 (f"/dashboard/session.json?session={sid}", 401, "unauthorized"),
                                 (f"/dashboard/session.json?session={sid}&api_key=not-a-key", 401, "unauthorized"),
                                 ("/dashboard/session.json", 400, "missing_field"),
                                 ("/dashboard/sessions.json", 401, "unauthorized")):
            status, body = await get(path)
            assert (status, body["error"]["code"]) == (want, code), (path, status, body)
            assert body["error"]["message"]
        async def listed():  # snapshots are written every snapshot_interval_s
            status, body = await get(f"/dashboard/sessions.json?api_key={KEY}")
            assert status == 200 and body["worker"]
            return body if body["sessions"] else None

        body = await until(listed, 30, "a snapshot in the session list")
        assert [s["session_id"] for s in body["sessions"]] == [sid]

    serve(tiny_engine, run, api_keys=ApiKeys({"ops": KEY}, {"ops": "operator"}), snapshot_interval_s=0.1)


@pytest.mark.embedded
def test_chromium_shows_a_live_session(embedded):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.runner import ModelRunner

    # The slow question must show "N behind": past flash_stale_s (20 s by default, reached on a
    # loaded machine) the server marks it flash.stale and the cell says "stale" instead.
    limits = EngineLimits(flash_stale_s=3600.0)
    engine = Engine(ModelRunner(embedded.model, embedded.tokenizer, embedded.name), limits).start()

    async def run(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "system_prompt": "Answer in a few words.",
                                      "flash": [{"question": "Which boat is this log about?", "max_tokens": 8}],
                                      "thinking": {"mode": "dual", "unit_tokens": 8, "final_tokens": 0}})
        sid = created["session_id"]
        await append(peer, sid, "Log of the fishing boat Dora, skipper Ana Reyes. ")
        # A question re-evaluated at most every 10 minutes: once new data lands, it is behind.
        slow = await peer.request({"type": "flash.register", "session_id": sid, "question": "Who is the skipper?",
                                   "max_tokens": 6, "min_interval_ms": 600_000})
        assert slow["type"] == "flash.registered", slow
        await flash_current(peer, sid, 1, "f2")
        await append(peer, sid, "06:10 left Porto Velho; wind light from the east. ")
        started = await peer.request({"type": "action.start", "session_id": sid, "dt_ms": 100, "horizon": 5})
        assert started["type"] == "action.started", started
        base = url.replace("ws://", "http://")
        page_url = f"{base}/dashboard?session={sid}&token={created['tokens']['dashboard']}"
        async with Browser() as page:
            await page.viewport(1280, 800)
            await page.navigate(page_url)
            await page.wait_for("document.getElementById('conn').textContent", want="live")
            # the session list (keys are off: open) and the live view of this session
            await page.wait_for(f"!!document.querySelector('tr.session[data-session-id=\"{sid}\"]')")
            await peer.send({"type": "robot.state", "session_id": sid, "state": [0.0, 0.0]})
            state = await flash_current(peer, sid, 2)
            assert state["answer"].strip()
            await page.wait_for(f"{row('f1')} .answer')?.textContent", want=state["answer"])
            await page.wait_for("document.getElementById('version').textContent", want="2")
            # the slow question shows how far behind it is
            await page.wait_for(f"{row('f2')}.stale .staleness')?.textContent.startsWith('1 behind')")
            assert await page.eval(f"{row('f2')} .version').textContent") == "v1"
            # live: new input shows up without a reload
            await append(peer, sid, '{"target": [1.0, 0.5]}')  # an observation for the policy
            state = await flash_current(peer, sid, 3)
            await page.wait_for("document.getElementById('version').textContent", want="3")
            await page.wait_for(f"{row('f1')} .answer')?.textContent", want=state["answer"])
            await page.wait_for(f"{row('f2')} .staleness')?.textContent.startsWith('2 behind')")
            # current: no marker (an unchanged answer's newer version comes with the next snapshot)
            await page.wait_for(f"{row('f1')}.stale') === null")
            assert await page.eval("document.querySelectorAll('#chart circle').length") >= 1
            # the chart has labelled axes: data_version across, mean probability up
            labels = await page.eval("[...document.querySelectorAll('#chart text.axis-label')].map(t => t.textContent)")
            assert labels == ["data_version", "mean prob"], labels
            assert await page.eval("document.querySelectorAll('#chart text.tick.x').length") >= 2
            assert await page.eval("[...document.querySelectorAll('#chart text.tick.y')].map(t => t.textContent)") == \
                ["0.00", "0.25", "0.50", "0.75", "1.00"]
            # the reasoning stream and the action timeline
            await page.wait_for("document.getElementById('reasoning').textContent.trim().length > 0")
            await page.wait_for("document.querySelectorAll('#actions li').length > 0")
            await page.wait_for("Number(document.getElementById('action-seq').textContent) > 0")
            lag = await page.eval("document.getElementById('lag').textContent")
            assert UNITS.fullmatch(lag), lag
            # at 1280x800 every column of the session table is on screen, no scrollbar
            fits = await page.eval("""(() => {
                const list = document.getElementById('list'), table = list.querySelector('table');
                const right = list.getBoundingClientRect().right;
                return table.scrollWidth <= list.clientWidth &&
                    [...table.querySelectorAll('th')].every(th => th.getBoundingClientRect().right <= right) &&
                    document.documentElement.scrollWidth <= window.innerWidth;
            })()""")
            assert fits, "the session table does not fit its panel at 1280x800"
            path = await page.screenshot("dashboard.png")
            print(f"dashboard screenshot: {path}")
            assert path.stat().st_size > 10_000
            # a wrong token: the panel says so instead of staying blank
            await page.navigate(f"{base}/dashboard?session={sid}&token=not-the-token")
            error = await page.wait_for("!document.getElementById('detail-error').hidden && "
                                        "document.getElementById('detail-error').textContent")
            assert "Cannot watch this session" in error and sid in error, error
            await page.screenshot("dashboard-wrong-token.png")
        # Under a virtual time budget the first paint is complete (it used to be all dashes).
        dom = await virtual_time_dom(page_url)
        for card in ("lag", "cache", "version", "action-seq"):
            value = re.search(rf'id="{card}" class="value">([^<]*)<', dom).group(1)
            assert value not in ("", "–"), (card, value)
        assert 'data-flash-id="f2"' in dom and "behind" in dom

    try:
        serve(engine, run, snapshot_interval_s=0.1)
    finally:
        engine.stop()


async def virtual_time_dom(url: str) -> str:
    """The DOM headless Chromium dumps after a 10 s virtual time budget (a screenshot job)."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        proc = await asyncio.create_subprocess_exec(
            chromium_path(), *BASE_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom",
            url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        return out.decode()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def row(flash_id: str) -> str:
    """The start of a selector for a flash row (close the quote and the call yourself)."""
    return f"document.querySelector('#flash tr[data-flash-id=\"{flash_id}\"]"


async def append(peer, sid, text):
    ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": text})
    assert ack["type"] == "input.ack", ack
    return ack


async def flash_current(peer, sid, version, flash_id="f1"):
    async def caught_up():
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        q = next(q for q in state["flash"] if q["flash_id"] == flash_id)
        return q if q.get("data_version", -1) >= version else None

    return await until(caught_up, 120, f"the flash answer of data_version {version}")


UNITS = re.compile(r"\d+ ms|\d+(\.\d)? s|\d+ min")


def visible_rows() -> str:
    return "[...document.querySelectorAll('#sessions tr.session')].filter((r) => r.offsetParent !== null)"


def test_closed_sessions_fold_into_one_row(tiny_engine):
    """Closed sessions (kept in the store until their retention ends) no longer pile up in the
    list: one "closed (N)" row folds them and opens them on a click. The list's lag reads
    "12 ms", not "12.34"."""

    async def run(url, server):
        base = url.replace("ws://", "http://")
        owner = await raw(url, api_key=KEY)
        sids = [(await owner.request({"type": "session.create"}))["session_id"] for _ in range(3)]
        for sid in sids:
            await append(owner, sid, "Ada keeps the light. ")
        for sid in sids[1:]:
            assert (await owner.request({"type": "session.close", "session_id": sid}))["type"] == "session.closed"

        async def listed():
            _, body = await asyncio.to_thread(get_json, f"{base}/dashboard/sessions.json?api_key={KEY}")
            closed = {s["session_id"] for s in body.get("sessions", []) if s.get("closed")}
            return closed == set(sids[1:]) and len(body["sessions"]) == 3

        await until(listed, 30, "two closed sessions and a live one in the session list")
        async with Browser() as page:
            await page.viewport(1280, 800)
            await page.navigate(f"{base}/dashboard?api_key={KEY}")
            await page.wait_for("document.getElementById('closed-toggle')?.textContent.endsWith('closed (2)')", 30)
            shown = await page.eval(f"{visible_rows()}.map((r) => r.dataset.sessionId)")
            assert shown == [sids[0]], shown
            lag_cell = f"{visible_rows()}[0].children[4].textContent"
            lag = await page.wait_for(f"{lag_cell} !== '–' && {lag_cell}", 30)
            assert UNITS.fullmatch(lag), lag
            await page.eval("document.getElementById('closed-toggle').click()")
            shown = await page.wait_for(f"{visible_rows()}.length === 3 && "
                                        f"{visible_rows()}.map((r) => r.dataset.sessionId)")
            assert set(shown[1:]) == set(sids[1:]) and shown[0] == sids[0], shown
            assert await page.eval("document.getElementById('closed-toggle').getAttribute('aria-expanded')") == "true"
            await page.screenshot("dashboard-closed-open.png")
            await page.eval("document.getElementById('closed-toggle').click()")
            await page.wait_for(f"{visible_rows()}.length === 1")

    serve(tiny_engine, run, api_keys=ApiKeys({"ops": KEY}, {"ops": "operator"}), snapshot_interval_s=0.1)


# Where each line of a cell starts: the index of the first character of every line after the first.
LINE_BREAKS = """((sel) => {
    const td = document.querySelector(sel);
    const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
    const tops = [];
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        for (let i = 0; i < node.length; i++) {
            const range = document.createRange();
            range.setStart(node, i);
            range.setEnd(node, i + 1);
            tops.push(Math.round(range.getBoundingClientRect().top));
        }
    }
    const breaks = [];
    tops.forEach((top, i) => { if (i > 0 && top > tops[i - 1]) breaks.push(i); });
    return {text: td.textContent, title: td.title, breaks, clipped: td.scrollWidth > td.clientWidth,
            overflow: getComputedStyle(td).textOverflow};
})(%s)"""


def test_flash_ids_wrap_between_words(tiny_engine):
    """A flash id wraps only after '-', '_' or '.', never inside a word (it broke anywhere);
    one longer than its column is cut with an ellipsis, the whole id in the title. The cards
    and the confidence read with units: "12 ms", "p 83%"."""
    ids = ("kitchen-door_open-check", "thermostatreadingnow")

    async def run(url, server):
        base = url.replace("ws://", "http://")
        owner = await raw(url)
        created = await owner.request({"type": "session.create"})
        sid = created["session_id"]
        await append(owner, sid, "The kitchen door is open. ")
        for flash_id, question in zip(ids, ("Is the door open?", "How warm is it?")):
            reply = await owner.request({"type": "flash.register", "session_id": sid, "flash_id": flash_id,
                                         "question": question, "max_tokens": 4})
            assert reply["type"] == "flash.registered", reply
        async with Browser() as page:
            await page.viewport(1280, 800)
            await page.navigate(f"{base}/dashboard?session={sid}&token={created['tokens']['dashboard']}")
            for flash_id in ids:
                await page.wait_for(f"{row(flash_id)}') !== null", 30)
            wrapped = await page.eval(LINE_BREAKS % json.dumps(f'#flash tr[data-flash-id="{ids[0]}"] td.id'))
            assert wrapped["text"] == ids[0] and wrapped["title"] == ids[0], wrapped
            assert all(ids[0][i - 1] in "-_." for i in wrapped["breaks"]), wrapped
            long = await page.eval(LINE_BREAKS % json.dumps(f'#flash tr[data-flash-id="{ids[1]}"] td.id'))
            assert long["breaks"] == [] and long["title"] == ids[1], long
            assert long["clipped"] and long["overflow"] == "ellipsis", long
            conf = await page.wait_for(f"{row(ids[0])} .confidence')?.textContent !== '–' && "
                                       f"{row(ids[0])} .confidence').textContent", 60)
            assert re.fullmatch(r"p \d+%, gap -?\d+\.\d", conf), conf
            lag = await page.wait_for("document.getElementById('lag').textContent !== '–' && "
                                      "document.getElementById('lag').textContent", 30)
            assert lag == "none yet" or UNITS.fullmatch(lag), lag
            await page.screenshot("dashboard-flash-ids.png")

    serve(tiny_engine, run, snapshot_interval_s=0.1)
