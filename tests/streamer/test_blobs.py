"""Content-addressed blobs in every store (media inputs of the event log): what is put comes
back byte for byte, a missing one is None, an address that is not a sha256 is refused, and a
frame survives the blob format exactly."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from redisutil import redis_server, redis_url  # noqa: F401  (fixtures)

from streamer.sessions.multimodal import blob_frame, frame_blob, frame_digest
from streamer.store import FileStore, Store, StoreError, open_store


def roundtrip(store) -> None:
    async def run():
        await store.start()
        data = bytes(range(256)) * 300
        digest = hashlib.sha256(data).hexdigest()
        await store.put_blob(digest, data)
        await store.put_blob(digest, data)  # idempotent
        assert await store.get_blob(digest) == data
        assert await store.get_blob("f" * 64) is None
        with pytest.raises(StoreError):
            await store.put_blob("../etc/passwd", data)
        await store.close()

    asyncio.run(run())


def test_memory_and_file_stores_keep_blobs(tmp_path):
    roundtrip(Store())
    roundtrip(FileStore(tmp_path / "state"))
    again = FileStore(tmp_path / "state")  # a restarted worker reads them back
    data = bytes(range(256)) * 300
    assert asyncio.run(again.get_blob(hashlib.sha256(data).hexdigest())) == data


def test_redis_store_keeps_blobs(redis_url):  # noqa: F811
    pytest.importorskip("redis")
    roundtrip(open_store(redis_url))


def test_a_frame_survives_its_blob():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)
    back = blob_frame(frame_blob(img))
    assert back.dtype == np.uint8 and np.array_equal(back, img)
    assert frame_digest(back) == frame_digest(img) != frame_digest(img[:, :-28])
