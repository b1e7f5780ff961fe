"""The paged KV pool: allocator, shared prefixes, parking, admission, and no leaks."""


import pytest
import torch
from helpers import Sync, driven, result, wait_until

from streamer.sessions.errors import EngineError
from streamer.sessions.kvcache import KVShape
from streamer.sessions.pool import BlockPool, OutOfBlocks, PagedCache
from streamer.sessions.sampling import SamplingParams

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
LONG_PROMPT = ("You are the harbour master's assistant. " * 12).strip()


def pool_of(blocks, block_size=4):
    return BlockPool(SHAPE, SHAPE.bytes_per_token * block_size * blocks, block_size)


def fill(pool, extent, value):
    pool.storage[:, :, :, pool.slots(extent)] = value


def test_allocator_check_then_commit():
    pool = pool_of(10)
    assert pool.can_allocate(10) and not pool.can_allocate(11)
    a = pool.allocate(3)
    assert (a.start, a.blocks) == (0, 3)  # first extent at the start
    b = pool.allocate(2)
    assert b.start > a.start + a.blocks  # placed mid-gap, leaving room for `a` to grow
    assert pool.extend(a, 1) and a.blocks == 4
    assert pool.free_blocks() == 4
    with pytest.raises(OutOfBlocks, match=r"KV budget of 5.0 KiB \(10 blocks of 4 tokens\) has 4 free blocks, 5 needed"):
        pool.allocate(5)
    pool.release(b)
    assert pool.free_blocks() == 6 and pool.extents == [a]


def test_move_and_compaction_keep_data():
    pool = pool_of(12)
    a, b, c = pool.allocate(2), pool.allocate(2), pool.allocate(2)
    for extent, value in ((a, 1.0), (b, 2.0), (c, 3.0)):
        fill(pool, extent, value)
    pool.release(b)
    pool.compact()
    assert pool.compactions == 1
    assert [e.start for e in sorted(pool.extents, key=lambda e: e.start)] == [0, 2]
    assert torch.all(pool.storage[:, :, :, pool.slots(a)] == 1.0)
    assert torch.all(pool.storage[:, :, :, pool.slots(c)] == 3.0)
    pool.move(a, 5)
    assert a.blocks == 5 and torch.all(pool.storage[:, :, :, pool.slots(a)][:, :, :, :8] == 1.0)
    assert pool.free_blocks() == 12 - 5 - 2


def test_fragmented_pool_compacts_to_fit():
    pool = pool_of(8)
    extents = [pool.allocate(1) for _ in range(8)]
    for e in extents[::2]:
        pool.release(e)
    assert pool.free_blocks() == 4
    big = pool.allocate(4)  # no 4-block gap until compaction
    assert big.blocks == 4 and pool.compactions == 1


def test_shared_prefix_ref_counts():
    pool = pool_of(16)
    tokens = list(range(10))  # two full blocks of 4, two tokens left over
    p1 = pool.prefix_for(tokens)
    p2 = pool.prefix_for(tokens)
    assert p1 is p2 and p1.length == 8 and p1.users == 2
    assert pool.prefix_for(tokens[:3]) is None  # no full block
    p1.drop()
    assert pool.prefixes and pool.free_blocks() == 14
    p2.drop()
    assert not pool.prefixes and pool.free_blocks() == 16


def test_paged_cache_grows_parks_and_restores():
    pool = pool_of(32)
    cache = PagedCache(pool, 100)
    cache.reserve(10)
    own = pool.storage[:, :, :, pool.slots(cache.extent)]
    own[:, :, :, :10] = torch.arange(10.0).unsqueeze(-1)
    cache.commit(10)
    before = cache.snapshot()
    blocker = pool.allocate(1)  # sits right after the cache's extent: growth must move it
    cache.reserve(30)
    assert torch.equal(cache.snapshot(), before)
    assert cache.park() == cache.pool.blocks_for(30) and cache.extent is None
    cache.restore()
    assert torch.equal(cache.snapshot(), before)
    cache.trim()
    assert cache.extent.blocks == 3
    clone = cache.clone(6)
    assert torch.equal(clone.snapshot(), before[:, :, :, :6])
    cache.release(), clone.release(), pool.release(blocker)
    assert pool.free_blocks() == 32


def new_session(engine, **kw):
    return Sync(engine).create_session(**kw)["session_id"]


def ask(engine, sid, question="Who keeps the light?", n=10):
    return result(engine, engine.query(sid, question, SamplingParams(max_tokens=n))).tokens


def test_shared_prefix_saves_pool_bytes_and_changes_no_answer(tiny):
    runner, ref = tiny
    results = {}
    for share in (True, False):
        engine = driven(runner, share_prefix=share)
        sids = [new_session(engine, system_prompt=LONG_PROMPT) for _ in range(4)]
        for i, sid in enumerate(sids):
            Sync(engine).append(sid, f"Ship {i} came in at dawn. ")
        used = engine.pool.used_bytes()
        results[share] = (used, [ask(engine, sid) for sid in sids], engine.sessions[sids[0]].state())
    (shared_bytes, shared_answers, state), (alone_bytes, alone_answers, _) = results[True], results[False]
    assert shared_answers == alone_answers
    assert shared_bytes < alone_bytes
    assert state["shared_prefix_tokens"] > 0
    # exactness with a shared prefix: the last logits equal one forward over the whole context
    engine = driven(runner, share_prefix=True)
    a, b = new_session(engine, system_prompt=LONG_PROMPT), new_session(engine, system_prompt=LONG_PROMPT)
    Sync(engine).append(b, "Second session text. ")
    session = engine.sessions[b]
    with torch.inference_mode():
        full = ref(torch.tensor([session.context_ids()])).logits[0, -1].float()
    assert (session.last_logits - full).abs().max().item() <= 1e-4
    with torch.inference_mode():
        ids = session.context_ids() + session.question_ids("Who keeps the light?")
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                pad_token_id=0, min_new_tokens=10)[0, len(ids):].tolist()
    assert ask(engine, b) == expected


@pytest.mark.parametrize("to_disk", [False, True])
def test_parked_then_restored_sessions_answer_the_same(tiny, to_disk, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path))
    engine = driven(tiny[0], park_idle_s=0.0, park_to_disk=to_disk)
    sid = new_session(engine)
    Sync(engine).append(sid, "The keeper is Ada Morrow and her cat is Pepper. ")
    first = ask(engine, sid)
    free_before = engine.pool.free_blocks()
    assert engine.core.memory.park_idle() == 1
    assert Sync(engine).session_state(sid)["parked"] is True
    assert engine.pool.free_blocks() > free_before
    if to_disk:
        assert list((tmp_path / "parked").iterdir())
    assert ask(engine, sid) == first  # restored transparently on the next question
    assert engine.stats.restored == 1 and not Sync(engine).session_state(sid)["parked"]
    Sync(engine).append(sid, "More. ")
    assert Sync(engine).session_state(sid)["inputs"] == 2


def budget_for(runner, tokens, block_size=16):
    return runner.kv_shape.bytes_per_token * block_size * (-(-tokens // block_size))


def test_admission_refuses_beyond_the_budget_and_names_it(tiny):
    runner = tiny[0]
    engine = driven(runner, kv_budget_bytes=budget_for(runner, 160), share_prefix=False, park_idle_s=60)
    sids = []
    with pytest.raises(EngineError) as exc:
        for _ in range(10):
            sids.append(new_session(engine))
    assert exc.value.code == "kv_budget_exceeded" and "KV budget" in str(exc.value)
    assert 1 <= len(sids) < 10 and engine.stats.admissions_refused == 1
    for sid in sids:  # the admitted sessions keep working
        assert ask(engine, sid, n=2)
    Sync(engine).close_session(sids[0])
    sids[0] = new_session(engine)  # room again


def test_admission_queue_admits_when_memory_frees(tiny):
    runner = tiny[0]
    engine = driven(runner, kv_budget_bytes=budget_for(runner, 64), share_prefix=False,
                            admission="queue", admission_timeout_s=30, park_idle_s=60)
    first = new_session(engine)
    waiting = engine.create_session()
    engine.run_until_idle()
    assert not waiting.done() and engine.stats.admissions_queued == 1  # it waits for memory
    Sync(engine).close_session(first)
    assert result(engine, waiting)["session_id"]
    engine2 = driven(runner, kv_budget_bytes=budget_for(runner, 64), share_prefix=False,
                     admission="queue", admission_timeout_s=0.3, park_idle_s=60)
    new_session(engine2)
    late = engine2.create_session()
    wait_until(lambda: engine2.core.next_wakeup() <= 0.001, timeout=5, what="the admission deadline")
    with pytest.raises(EngineError, match="after waiting"):
        result(engine2, late)


def test_pressure_parks_idle_sessions_and_they_come_back(tiny):
    runner = tiny[0]
    engine = driven(runner, kv_budget_bytes=budget_for(runner, 240), share_prefix=False, park_idle_s=0.0)
    a = new_session(engine)
    Sync(engine).append(a, "Alpha " * 40)
    answer_a = ask(engine, a)
    b = new_session(engine)
    Sync(engine).append(b, "Beta " * 120)  # needs a's blocks: a is parked
    assert engine.stats.parked >= 1
    assert ask(engine, a) == answer_a
    assert engine.stats.restored >= 1


def test_no_leak_over_many_sessions(tiny):
    engine = driven(tiny[0])
    total = engine.pool.num_blocks
    for i in range(40):
        sid = new_session(engine, system_prompt=LONG_PROMPT if i % 2 else None)
        Sync(engine).append(sid, f"Session {i} data. " * (i % 5 + 1))
        ask(engine, sid, n=3)
        Sync(engine).close_session(sid)
    assert engine.pool.free_blocks() == total
    assert not engine.pool.prefixes and not engine.pool.extents


def test_every_cache_keeps_the_cache_contract(tiny):
    """The engine, the runner and the attention plans use caches only through the protocols in
    sessions/kvcache.py; each cache type implements them."""
    from streamer.sessions.kvcache import KVBuffer, KVCache, SessionCache

    runner = tiny[0]
    pool = BlockPool(runner.kv_shape, 1 << 20)
    prefix = pool.prefix_for(list(range(40)))
    for cache in (KVCache(runner.kv_shape, 64), PagedCache(pool, 64, prefix), PagedCache(pool, 64)):
        assert isinstance(cache, SessionCache) and isinstance(cache, KVBuffer)
    assert isinstance(prefix, KVBuffer) and not isinstance(prefix, SessionCache)  # read-only: no crop or park
