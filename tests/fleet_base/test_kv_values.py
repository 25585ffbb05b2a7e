"""`kv_values` reads a bucket's key range in one pass on a real nats-server: every live key
once with its latest value and revision, deleted and purged keys left out, an empty range
empty, and a range larger than one pull whole. Read many times while a writer adds keys, a
range that held values before the read never comes back short (nats-py's watcher could
report it caught up before its first entry)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig

from control_plane.local.nats_server import NatsServer
from fleet_base.nats_io import KV_VALUES_BATCH, kv_values

BUCKET = "things"


@pytest.fixture()
async def js(tmp_path: Path) -> AsyncIterator[JetStreamContext]:
    server = NatsServer(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1))
        yield js
    finally:
        await nc.close()
        server.stop()


async def test_live_keys_latest_values_and_revisions_deletes_and_purges_left_out(js) -> None:
    kv = await js.key_value(BUCKET)
    assert await kv_values(js, BUCKET) == []
    await kv.put("a.1", b"old")
    rev = await kv.put("a.1", b"new")
    a2 = await kv.put("a.2", b"two")
    await kv.put("a.3", b"gone")
    await kv.delete("a.3")
    await kv.put("a.4", b"purged")
    await kv.purge("a.4")
    b1 = await kv.put("b.1", b"other")
    assert sorted(await kv_values(js, BUCKET, "a.*")) == [("a.1", b"new", rev), ("a.2", b"two", a2)]
    assert await kv_values(js, BUCKET, "b.*") == [("b.1", b"other", b1)]
    assert await kv_values(js, BUCKET, "c.*") == []
    assert len(await kv_values(js, BUCKET)) == 3


async def test_a_range_larger_than_one_pull_is_read_whole(js) -> None:
    kv = await js.key_value(BUCKET)
    n = KV_VALUES_BATCH * 2 + 7
    await asyncio.gather(*(kv.put(f"r.{i}", str(i).encode()) for i in range(n)))
    found = await kv_values(js, BUCKET, "r.*")
    assert sorted(int(v) for _, v, _ in found) == list(range(n))


async def test_a_range_read_while_keys_are_written_is_never_short(js) -> None:
    kv = await js.key_value(BUCKET)
    await asyncio.gather(*(kv.put(f"w.{i}", b"x") for i in range(50)))
    written = [50]

    async def writer() -> None:
        while written[0] < 3000:
            await kv.put(f"w.{written[0]}", b"x")
            written[0] += 1

    task = asyncio.create_task(writer())
    try:
        reads = 0
        while not task.done():
            before = written[0]
            found = await asyncio.wait_for(kv_values(js, BUCKET, "w.*"), 10)
            assert before <= len(found) <= written[0]
            assert len({key for key, _, _ in found}) == len(found)
            reads += 1
        assert reads >= 3
    finally:
        written[0] = 1 << 30
        await task


async def test_keys_overwritten_during_the_read_come_back_once_with_their_latest_value(js) -> None:
    kv = await js.key_value(BUCKET)
    await asyncio.gather(*(kv.put(f"o.{i}", b"0") for i in range(200)))
    done = asyncio.Event()

    async def overwriter() -> None:
        for n in range(1, 1500):
            await kv.put(f"o.{n * 37 % 200}", str(n).encode())
            await asyncio.sleep(0.001)
        done.set()

    task = asyncio.create_task(overwriter())
    try:
        while not done.is_set():
            found = await asyncio.wait_for(kv_values(js, BUCKET, "o.*"), 10)
            assert sorted(key for key, _, _ in found) == sorted(f"o.{i}" for i in range(200))
    finally:
        await task
    final = {key: value for key, value, _ in await kv_values(js, BUCKET, "o.*")}
    for key in final:
        assert final[key] == (await kv.get(key)).value
