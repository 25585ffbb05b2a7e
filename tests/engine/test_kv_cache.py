"""Paged KV cache bookkeeping: unit tests plus a stateful property test that plays scheduler.

The property test keeps a shadow of what the "model" wrote into every slot: for each slot,
the writer's cache_salt and the full token prefix up to and including that slot (the KV of
a token depends on all earlier tokens). A cache hit is correct only if every slot of every
hit block holds exactly this request's salt and prefix.

Over ~400 lines: the unit tests and the stateful property test share the shadow model of
slot contents.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.kv_cache import (
    BlockPool,
    KVCacheManager,
    hash_block,
    hash_request_blocks,
    root_hash,
)
from engine.request import Request
from fleet_base.sampling_params import SamplingParams

_PARAMS = SamplingParams()


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=_PARAMS, cache_salt=salt)


def snapshot(mgr: KVCacheManager, rids: list[str]) -> tuple:
    """Everything observable about the cache except stats."""
    pool = mgr.block_pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted(pool.cached_items()),
        {rid: mgr.get_block_ids(rid) for rid in rids},
        mgr.num_free_blocks(),
    )


def prefill(mgr: KVCacheManager, req: Request) -> list[int]:
    """Admit a request through the cache and compute its whole prompt; returns the hit ids."""
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n, hits)
    req.num_computed_tokens = req.num_tokens
    return hits


# ---- hashing ----------------------------------------------------------------------------


def test_hash_is_deterministic_chained_and_salted() -> None:
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    hs = hash_request_blocks(toks, 4)
    assert len(hs) == 2  # the partial third block has no key
    assert hs == hash_request_blocks(toks, 4)
    assert hs[0] == hash_block(root_hash(None), [1, 2, 3, 4])
    assert hs[1] == hash_block(hs[0], [5, 6, 7, 8])
    # Same tokens, other parent or other salt: other key.
    assert hash_block(hs[0], [1, 2, 3, 4]) != hs[0]
    assert hash_request_blocks(toks, 4, "a") != hs
    assert hash_request_blocks(toks, 4, "a") != hash_request_blocks(toks, 4, "b")
    assert root_hash("") != root_hash(None)
    assert len(hs[0]) == 32


# ---- unit behaviour ---------------------------------------------------------------------


def test_fresh_blocks_come_out_in_id_order() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = make_req("a", list(range(10)))
    prefill(mgr, req)
    assert mgr.get_block_ids("a") == [0, 1, 2]
    assert mgr.num_free_blocks() == 5
    assert mgr.usage == pytest.approx(3 / 8)
    assert mgr.block_pool.free_block_ids() == [3, 4, 5, 6, 7]


def test_last_token_is_never_served_from_cache() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", list(range(8)))  # exactly two full blocks
    prefill(mgr, a)
    a_blocks = mgr.get_block_ids("a")
    assert len(mgr.block_pool.cached_items()) == 2

    # Identical 8-token prompt: only 7 tokens may be reused -> one block.
    assert mgr.get_computed_blocks(make_req("b", list(range(8)))) == (a_blocks[:1], 4)
    # One more token: both blocks.
    assert mgr.get_computed_blocks(make_req("c", [*range(8), 99])) == (a_blocks, 8)
    # Shorter than a block, or diverging inside the first block: nothing.
    assert mgr.get_computed_blocks(make_req("d", [0, 1, 2])) == ([], 0)
    assert mgr.get_computed_blocks(make_req("e", [0, 1, 2, 5, 4, 5, 6, 7, 8])) == ([], 0)
    # Diverging in the second block: the first one only.
    assert mgr.get_computed_blocks(make_req("f", [0, 1, 2, 3, 4, 5, 6, 0, 9])) == (a_blocks[:1], 4)


def test_get_computed_blocks_changes_only_stats() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])
    prefill(mgr, a)
    mgr.free(a)
    before = snapshot(mgr, ["a", "b"])
    hits, n = mgr.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5, 6]))
    assert n == 4 and len(hits) == 2
    assert snapshot(mgr, ["a", "b"]) == before


def test_reuse_after_free_takes_blocks_back_from_the_free_queue() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", list(range(9)))
    prefill(mgr, a)
    a_blocks = mgr.get_block_ids("a")
    mgr.free(a)
    assert mgr.num_free_blocks() == 6
    assert mgr.get_block_ids("a") == []

    b = make_req("b", [*range(8), 42, 43])
    hits, n = mgr.get_computed_blocks(b)
    assert (hits, n) == (a_blocks[:2], 8)
    assert mgr.allocate_slots(b, b.num_tokens - n, hits)
    table = mgr.get_block_ids("b")
    assert table[:2] == a_blocks[:2]
    assert len(table) == 3  # 10 tokens
    assert mgr.num_free_blocks() == 3
    pool = mgr.block_pool
    assert all(pool.blocks[i].ref_cnt == 1 for i in table)
    assert not set(table) & set(pool.free_block_ids())


def test_shared_blocks_are_reference_counted() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = make_req("a", [7, 7, 8, 8, 9])
    prefill(mgr, a)
    b = make_req("b", [7, 7, 8, 8, 1])
    hits = prefill(mgr, b)
    assert hits == mgr.get_block_ids("a")[:2]
    pool = mgr.block_pool
    assert [pool.blocks[i].ref_cnt for i in hits] == [2, 2]
    mgr.free(a)
    assert [pool.blocks[i].ref_cnt for i in hits] == [1, 1]
    assert not set(hits) & set(pool.free_block_ids())
    mgr.free(b)
    assert [pool.blocks[i].ref_cnt for i in hits] == [0, 0]
    assert mgr.num_free_blocks() == 8


def test_eviction_is_lru_and_unused_blocks_go_first() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    reqs = {name: make_req(name, toks) for name, toks in {"a": [1, 1], "b": [2, 2], "c": [3, 3]}.items()}
    for r in reqs.values():
        prefill(mgr, r)
    ids = {name: mgr.get_block_ids(name)[0] for name in reqs}
    assert ids == {"a": 0, "b": 1, "c": 2}
    for name in ("b", "c", "a"):
        mgr.free(reqs[name])
    assert mgr.block_pool.free_block_ids() == [3, 1, 2, 0]

    def probe(tokens: list[int]) -> int:
        return mgr.get_computed_blocks(make_req("probe", [*tokens, 0]))[1]

    assert probe([1, 1]) == probe([2, 2]) == probe([3, 3]) == 2
    prefill(mgr, make_req("d", [4, 4]))  # takes the never-used block 3
    assert mgr.get_block_ids("d") == [3]
    assert probe([2, 2]) == 2
    prefill(mgr, make_req("e", [5, 5]))  # evicts b's block: least recently freed
    assert mgr.get_block_ids("e") == [1]
    assert probe([2, 2]) == 0
    assert probe([1, 1]) == probe([3, 3]) == 2
    prefill(mgr, make_req("f", [6, 6]))  # then c's
    assert mgr.get_block_ids("f") == [2]
    assert probe([3, 3]) == 0 and probe([1, 1]) == 2


def test_free_releases_tail_blocks_first() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5, 6])
    prefill(mgr, a)
    mgr.free(a)
    assert mgr.block_pool.free_block_ids() == [3, 4, 2, 1, 0]
    # Taking three blocks evicts the tail (block 2), so the two-block prefix survives.
    prefill(mgr, make_req("x", [9, 9, 9, 9, 9, 9]))
    assert mgr.get_block_ids("x") == [3, 4, 2]
    assert mgr.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5, 6])) == ([0, 1], 4)


def test_failed_allocation_changes_nothing_and_free_hits_are_not_capacity() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5, 6])
    prefill(mgr, a)
    mgr.free(a)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, n = mgr.get_computed_blocks(b)
    assert (hits, n) == ([0, 1, 2], 6)
    before = snapshot(mgr, ["a", "b"])
    # 9 tokens -> 5 blocks: 3 hits + 2 new, but only one block is free besides the hits.
    assert not mgr.allocate_slots(b, 3, hits)
    assert snapshot(mgr, ["a", "b"]) == before
    # A chunk that needs one new block fits.
    assert mgr.allocate_slots(b, 2, hits)
    assert mgr.get_block_ids("b") == [0, 1, 2, 3]
    assert mgr.num_free_blocks() == 0
    b.num_computed_tokens = 8
    before = snapshot(mgr, ["b"])
    assert not mgr.allocate_slots(b, 1)
    assert snapshot(mgr, ["b"]) == before


def test_stats_count_tokens_queried_and_hit() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    prefill(mgr, make_req("a", list(range(10))))
    assert (mgr.stats.prefix_cache_queries, mgr.stats.prefix_cache_hits) == (10, 0)
    mgr.get_computed_blocks(make_req("b", list(range(12))))
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (22, 8)
    mgr.get_computed_blocks(make_req("c", [*range(4), 50, 51]))
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (28, 12)
    assert mgr.stats.hit_rate == pytest.approx(12 / 28)


def test_caching_off_never_hits_and_never_hashes() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = make_req("a", [1, 2, 3, 4, 5])
    prefill(mgr, a)
    assert mgr.block_pool.cached_items() == []
    mgr.free(a)
    assert mgr.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert mgr.stats.prefix_cache_queries == 0
    assert mgr.num_free_blocks() == 8


def test_cache_salt_separates_identical_tokens() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    prefill(mgr, make_req("a", [1, 2, 3, 4, 5], salt="tenant-1"))
    assert mgr.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5], salt="tenant-2"))[1] == 0
    assert mgr.get_computed_blocks(make_req("c", [1, 2, 3, 4, 5]))[1] == 0
    assert mgr.get_computed_blocks(make_req("d", [1, 2, 3, 4, 5], salt="tenant-1"))[1] == 4


def test_duplicate_content_is_cached_once() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a, b = make_req("a", [1, 2, 3, 4, 5]), make_req("b", [1, 2, 3, 4, 5])
    assert mgr.get_computed_blocks(a) == ([], 0)
    assert mgr.get_computed_blocks(b) == ([], 0)  # admitted in the same step, before a ran
    assert mgr.allocate_slots(a, 5) and mgr.allocate_slots(b, 5)
    a_ids, b_ids = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert not set(a_ids) & set(b_ids)
    assert sorted(i for _, i in mgr.block_pool.cached_items()) == a_ids[:2]
    assert all(mgr.block_pool.blocks[i].block_hash is None for i in b_ids)
    mgr.free(a)
    mgr.free(b)
    assert mgr.get_computed_blocks(make_req("c", [1, 2, 3, 4, 9])) == (a_ids[:2], 4)


def test_blocks_are_cached_when_a_decode_fills_them() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    r = make_req("r", [5, 6, 7])
    prefill(mgr, r)
    assert mgr.block_pool.cached_items() == []
    r.append_output_token(8)
    assert mgr.allocate_slots(r, 1)  # computes token 8 -> block 0 is full
    r.num_computed_tokens += 1
    assert [i for _, i in mgr.block_pool.cached_items()] == [0]
    r.append_output_token(9)
    assert mgr.allocate_slots(r, 1)
    assert mgr.get_block_ids("r") == [0, 1]
    assert mgr.get_computed_blocks(make_req("s", [5, 6, 7, 8, 1])) == ([0], 4)


def test_preempted_request_finds_its_own_blocks_again() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    r = make_req("r", [1, 2, 3, 4, 5])
    prefill(mgr, r)
    r.append_output_token(6)
    assert mgr.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    r.append_output_token(7)
    table = mgr.get_block_ids("r")
    mgr.free(r)
    r.num_computed_tokens = 0
    assert mgr.get_computed_blocks(r) == (table[:3], 6)


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = make_req("a", [1, 2, 3])
    prefill(mgr, a)
    assert not mgr.reset_prefix_cache()
    assert mgr.block_pool.cached_items()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.block_pool.cached_items() == []
    assert mgr.get_computed_blocks(make_req("b", [1, 2, 3])) == ([], 0)


def test_free_of_unknown_request_is_a_noop() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    before = snapshot(mgr, ["ghost"])
    mgr.free(make_req("ghost", [1]))
    assert snapshot(mgr, ["ghost"]) == before
    assert mgr.get_block_ids("ghost") == []


def test_block_pool_rejects_overallocation_and_double_free() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError):
        pool.free_blocks(blocks[:1])


# ---- stateful property test -------------------------------------------------------------

VOCAB = st.integers(0, 2)  # tiny vocabulary: prefixes collide often
SALTS = st.sampled_from([None, "s"])
MAX_TOKENS = 20
MAX_LIVE = 6

Slot = tuple[str | None, tuple[int, ...]] | None


class KVCacheMachine(RuleBasedStateMachine):
    """Plays scheduler + model runner against the manager and checks it after every step."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 14),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.bs = block_size
        self.mgr = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.live: dict[str, Request] = {}
        self.shadow: dict[int, list[Slot]] = {i: [None] * block_size for i in range(num_blocks)}
        self.next_id = 0

    # -- helpers --

    def _running(self) -> list[str]:
        return sorted(r for r in self.live if self.mgr.has_request(r))

    def _snap(self) -> tuple:
        return snapshot(self.mgr, sorted(self.live))

    def _check_hits(self, req: Request, hits: list[int], n: int) -> None:
        bs = self.bs
        assert n == len(hits) * bs
        assert n <= req.num_tokens - 1
        assert len(set(hits)) == len(hits)
        toks = req.all_token_ids
        for i, block_id in enumerate(hits):
            expected = [(req.cache_salt, tuple(toks[: i * bs + o + 1])) for o in range(bs)]
            assert self.shadow[block_id] == expected, f"hit block {block_id} holds other KV"

    def _write(self, req: Request, start: int, num_new: int, old_len: int, num_hits: int) -> None:
        """The model writes KV for positions [start, start+num_new); fresh blocks start blank."""
        table = self.mgr.get_block_ids(req.request_id)
        for block_id in table[max(old_len, num_hits) :]:
            self.shadow[block_id] = [None] * self.bs
        toks = req.all_token_ids
        for pos in range(start, start + num_new):
            self.shadow[table[pos // self.bs]][pos % self.bs] = (req.cache_salt, tuple(toks[: pos + 1]))

    # -- rules --

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=12), salt=SALTS)
    def add_request(self, tokens: list[int], salt: str | None) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.live[rid] = make_req(rid, tokens, salt)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        mgr = self.mgr
        old_len = len(mgr.get_block_ids(rid))
        hits: list[int] = []
        n_hit = 0
        if not mgr.has_request(rid):
            assert req.num_computed_tokens == 0
            before, stats = self._snap(), (mgr.prefix_cache_queries, mgr.prefix_cache_hits)
            hits, n_hit = mgr.get_computed_blocks(req)
            assert self._snap() == before
            if mgr.enable_caching:
                assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (
                    stats[0] + req.num_tokens,
                    stats[1] + n_hit,
                )
            else:
                assert (hits, n_hit) == ([], 0)
                assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == stats
            self._check_hits(req, hits, n_hit)
        start = req.num_computed_tokens + n_hit
        num_new = data.draw(st.integers(1, req.num_tokens - start))
        before = self._snap()
        if not mgr.allocate_slots(req, num_new, hits):
            assert self._snap() == before
            return
        self._write(req, start, num_new, old_len, len(hits))
        req.num_computed_tokens = start + num_new
        assert len(mgr.get_block_ids(rid)) == -(-req.num_computed_tokens // self.bs)
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_TOKENS:
                mgr.free(req)  # finished by length
                del self.live[rid]
            else:
                req.append_output_token(data.draw(VOCAB))  # sampled the next token

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._running()))
        self.mgr.free(self.live[rid])
        self.live[rid].num_computed_tokens = 0
        assert self.mgr.get_block_ids(rid) == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        held = self.mgr.has_request(rid)
        before = self._snap()
        self.mgr.free(self.live.pop(rid))
        if not held:  # aborting a waiting request: nothing to release
            assert self._snap()[:3] == before[:3]

    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=12), salt=SALTS)
    def probe(self, tokens: list[int], salt: str | None) -> None:
        """A lookup the scheduler then decides not to admit."""
        req = make_req("probe", tokens, salt)
        before = self._snap()
        hits, n = self.mgr.get_computed_blocks(req)
        assert self._snap() == before
        self._check_hits(req, hits, n)

    @rule()
    def reset_prefix_cache(self) -> None:
        in_use = bool(self._running())
        assert self.mgr.reset_prefix_cache() == (not in_use)
        if not in_use:
            assert self.mgr.block_pool.cached_items() == []

    # -- invariants --

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        mgr, pool = self.mgr, self.mgr.block_pool
        refs: Counter[int] = Counter()
        for rid in self.live:
            table = mgr.get_block_ids(rid)
            assert len(set(table)) == len(table)
            refs.update(table)
        free = pool.free_block_ids()
        assert len(set(free)) == len(free) == mgr.num_free_blocks()
        assert not set(free) & set(refs)
        assert len(free) + len(refs) == mgr.num_blocks
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id] >= 0
        if not refs:
            assert mgr.num_free_blocks() == mgr.num_blocks
        assert mgr.usage == pytest.approx(1 - len(free) / mgr.num_blocks)

    @invariant()
    def cache_index_matches_block_contents(self) -> None:
        pool = self.mgr.block_pool
        items = pool.cached_items()
        if not self.mgr.enable_caching:
            assert items == []
        assert len({i for _, i in items}) == len(items)
        assert sum(b.block_hash is not None for b in pool.blocks) == len(items)
        for h, block_id in items:
            assert pool.blocks[block_id].block_hash == h
            slots = self.shadow[block_id]
            assert all(s is not None for s in slots), "a cached block was never fully written"
            salt, prefix = slots[-1]  # type: ignore[misc]
            assert hash_request_blocks(prefix, self.bs, salt)[-1] == h


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
