"""The engine's KV event log: what the block pool caches and evicts, batched and
numbered; snapshots for new, restarted or lagging readers; bounded memory."""

from __future__ import annotations

from engine.kv_cache import KVCacheManager, KvEventLog
from engine.request import Request
from fleet_base.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1))


def _replay(ops, into: set[bytes]) -> set[bytes]:
    for kind, hashes, _tier in ops:
        if kind == "cleared":
            into.clear()
        elif kind == "stored":
            into.update(hashes)
        else:
            into.difference_update(hashes)
    return into


def test_events_follow_the_pool_and_a_reader_can_rebuild_its_set() -> None:
    log = KvEventLog(block_size=4)
    kv = KVCacheManager(num_blocks=6, block_size=4, events=log)
    first = log.read(None, None)
    assert first.snapshot and first.ops == [("stored", [], "device")]
    seen: set[bytes] = set()
    after = first.seq
    for i in range(8):  # more prompts than blocks: later ones evict earlier cached blocks
        req = _req(f"r{i}", [i * 100 + t for t in range(9)])
        assert kv.allocate_slots(req, 9)
        kv.free(req)
        read = log.read(log.epoch, after)
        assert not read.snapshot and read.seq == after + 1
        _replay(read.ops, seen)
        after = read.seq
        assert seen == {h for h, _ in kv.block_pool.cached_items()}
    assert any(kind == "removed" for kind, _, _ in read.ops) or len(seen) <= 6
    kv.reset_prefix_cache()
    assert _replay(log.read(log.epoch, after).ops, seen) == set()


def test_new_restarted_or_lagging_readers_get_a_snapshot() -> None:
    log = KvEventLog(block_size=4, max_batches=2)
    for i in range(5):
        log.stored(bytes([i]) * 32)
        log.read(log.epoch, None)  # each read seals a batch
    assert log.read("another-epoch", 3).snapshot  # the engine restarted since
    lag = log.read(log.epoch, 1)  # batch 2 is no longer kept
    assert lag.snapshot and set(lag.ops[0][1]) == {bytes([i]) * 32 for i in range(5)}
    assert not log.read(log.epoch, lag.seq).snapshot
    assert not log.has_news(log.epoch, lag.seq)
    log.removed(bytes([0]) * 32)
    assert log.has_news(log.epoch, lag.seq)


def test_unread_backlog_is_bounded() -> None:
    log = KvEventLog(block_size=4, max_pending=10)
    start = log.read(None, None)
    for i in range(25):
        log.stored(i.to_bytes(32, "big"))
    read = log.read(log.epoch, start.seq)
    assert read.snapshot and len(read.ops[0][1]) == 25 and log.num_cached == 25
