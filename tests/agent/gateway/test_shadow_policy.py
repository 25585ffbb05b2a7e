"""Shadow traffic's decisions as tables: the share a draw copies, where a copy may go (or
why it is dropped), who users reach, which requests are greedy, and the comparison."""

from __future__ import annotations

import pytest

from agent.gateway.itl import TokenClock
from agent.gateway.plan import ReplicaFacts
from agent.gateway.shadow_policy import (
    MAX_OUTPUT_CHARS,
    MAX_OUTPUT_TOKENS,
    Comparison,
    Output,
    choose_replica,
    compare,
    copied,
    draw,
    estimate_pieces,
    first_difference,
    greedy,
    serves_users,
    shadow_version,
)
from agent.gateway.sse import StreamObserver
from fleet_base.protocol import RoutingTable, ShadowTarget, VersionWeight


@pytest.mark.parametrize("share", [0.01, 0.1, 0.5, 0.9, 1.0])
def test_the_realised_share_holds(share: float) -> None:
    n = 20_000
    taken = sum(copied(share, draw(f"req-{i:06x}", "salt")) for i in range(n))
    # binomial: 4 standard deviations (and exactly all at share 1)
    assert abs(taken / n - share) <= 4 * (share * (1 - share) / n) ** 0.5
    if share == 1.0:
        assert taken == n


def test_the_draw_is_fixed_per_request_and_salt() -> None:
    assert draw("req-1", "a") == draw("req-1", "a")
    assert 0 <= draw("req-1", "a") < 1
    # another gateway's salt draws anew: a client choosing its request ids chooses nothing
    assert draw("req-1", "a") != draw("req-1", "b")
    # the draws of nearby ids are not correlated: copied ones at 50% interleave
    flags = [copied(0.5, draw(f"req-{i}", "s")) for i in range(64)]
    assert 16 < sum(flags) < 48 and flags != sorted(flags)


def _route(shadow: ShadowTarget | None, versions: list[tuple[int, float]]) -> RoutingTable:
    return RoutingTable(
        deployment="d", versions=[VersionWeight(version=v, weight=w) for v, w in versions], shadow=shadow
    )


@pytest.mark.parametrize(
    ("shadow", "versions", "version", "serves"),
    [
        (None, [(1, 1.0)], 2, True),  # no shadow: every version serves
        (ShadowTarget(version=2, share=0.5), [(1, 1.0)], 2, False),  # unweighted shadow: copies only
        (ShadowTarget(version=2, share=0.5), [(1, 1.0), (2, 0.0)], 2, False),  # weight 0: copies only
        (ShadowTarget(version=2, share=0.5), [(1, 1.0)], 1, True),  # the original version serves
        (ShadowTarget(version=2, share=0.5), [(1, 0.9), (2, 0.1)], 2, True),  # a canary weight: users too
    ],
)
def test_users_never_reach_an_unweighted_shadow_version(shadow, versions, version, serves) -> None:
    route = _route(shadow, versions)
    assert serves_users(route, version) is serves
    assert shadow_version(route) == (shadow.version if shadow else None)
    assert serves_users(None, version)


def R(rid: str, version: int = 2, in_flight: int = 0, **kw) -> ReplicaFacts:
    return ReplicaFacts(rid, f"http://{rid}", version, in_flight=in_flight, **kw)


@pytest.mark.parametrize(
    ("replicas", "allowed", "here", "adapter", "outcome", "picked"),
    [
        # the least busy free replica of the shadow version
        ([R("a", in_flight=1), R("b")], None, "us", None, "sent", "b"),
        # every shadow replica at its slots: dropped, never queued
        ([R("a", in_flight=2), R("b", in_flight=2)], None, "us", None, "dropped_busy", None),
        # only the original version here: nothing to copy to
        ([R("a", version=1)], None, "us", None, "dropped_busy", None),
        # no replica at all
        ([], None, "us", None, "dropped_busy", None),
        # a replica that just failed is not sent copies
        ([R("a", recently_failed=True)], None, "us", None, "dropped_busy", None),
        # residency: this cluster outside the request's allowed set (even with a free replica)
        ([R("a")], frozenset({"ca"}), "us", None, "dropped_residency", None),
        ([R("a")], frozenset({"ca"}), "", None, "dropped_residency", None),
        ([R("a")], frozenset({"ca", "us"}), "us", None, "sent", "a"),
        # LoRA: the adapter resident, or room to load it; never an eviction, never LoRA off
        ([R("a", adapters=frozenset({"x"}), max_adapters=1)], None, "us", "x", "sent", "a"),
        ([R("a", max_adapters=1)], None, "us", "x", "sent", "a"),
        ([R("a", adapters=frozenset({"y"}), max_adapters=1)], None, "us", "x", "dropped_busy", None),
        ([R("a")], None, "us", "x", "dropped_busy", None),
    ],
)
def test_where_a_copy_goes(replicas, allowed, here, adapter, outcome, picked) -> None:
    choice = choose_replica(replicas, 2, 2, allowed=allowed, jurisdiction=here, adapter=adapter)
    assert choice.outcome == outcome
    assert (choice.replica.replica_id if choice.replica else None) == picked


@pytest.mark.parametrize(
    ("body", "sequences", "expected"),
    [
        ({"temperature": 0}, 1, True),
        ({"temperature": 0.0}, 1, True),
        ({"top_k": 1}, 1, True),
        ({"temperature": 0.7, "top_k": 1}, 1, True),
        ({}, 1, False),  # the default temperature samples
        ({"temperature": 0.2}, 1, False),
        ({"top_k": 2}, 1, False),
        ({"temperature": False}, 1, False),
        ({"temperature": "0"}, 1, False),
        ({"temperature": 0}, 2, False),  # n > 1: not one comparable output
    ],
)
def test_greedy_requests(body, sequences, expected) -> None:
    assert greedy(body, sequences) is expected


@pytest.mark.parametrize(
    ("a", "b", "diff"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([1, 2, 3], [7, 2, 3], 0),
        ([1, 2, 3], [1, 2], 2),  # the copy stopped early: it differs where it ended
        ([1, 2], [1, 2, 3], 2),
        ([], [], None),
        ([], [5], 0),
    ],
)
def test_first_differing_token(a, b, diff) -> None:
    assert first_difference(a, b) == diff


def _ids(ids: list[int]) -> Output:
    out = Output()
    out.add_ids(ids)
    return out


def _text(text: str) -> Output:
    out = Output()
    out.add_text(text)
    return out


def words(text: str) -> list[str]:
    return text.split(" ")


@pytest.mark.parametrize(
    ("original", "copy", "tokenize", "expected"),
    [
        # token ids on both sides: compared as ids
        (_ids([5, 6, 7]), _ids([5, 6, 7]), None, Comparison(True, None)),
        (_ids([5, 6, 7]), _ids([5, 6, 8]), None, Comparison(False, 2)),
        # ids on one side only: the text is compared, split by the tokenizer
        (_text("the cat sat"), _text("the cat sat"), words, Comparison(True, None)),
        (_text("the cat sat"), _text("the dog sat"), words, Comparison(False, 1)),
        (_text("the cat sat"), _text("the cat"), words, Comparison(False, 2)),
        # no tokenizer: 4-character pieces (the gateway's estimate of a token)
        (_text("abcdefghij"), _text("abcdefgXij"), None, Comparison(False, 1)),
        (_text(""), _text(""), None, Comparison(True, None)),
    ],
)
def test_comparison(original, copy, tokenize, expected) -> None:
    assert compare(original, copy, tokenize) == expected


def test_ids_on_one_side_fall_back_to_text() -> None:
    original = _ids([1, 2])
    original.add_text("same")
    assert compare(original, _text("same")) == Comparison(True, None)


def test_outputs_are_held_bounded_and_only_the_common_prefix_compares() -> None:
    long_ids = list(range(MAX_OUTPUT_TOKENS + 10))
    a, b = _ids(long_ids), _ids(long_ids)
    assert len(a.ids) == MAX_OUTPUT_TOKENS and a.truncated
    assert compare(a, b) == Comparison(None, None)  # equal as far as held: not comparable
    c = _ids([*long_ids[:100], -1, *long_ids[101:]])
    assert compare(a, c) == Comparison(False, 100)  # a difference within the bound is reported
    text = _text("x" * (MAX_OUTPUT_CHARS + 5))
    assert text.chars == MAX_OUTPUT_CHARS and text.truncated
    assert estimate_pieces("abcdefghi") == ["abcd", "efgh", "i"]


def test_a_stream_observer_hands_the_first_choice_text_to_the_comparison() -> None:
    out = Output()
    observer = StreamObserver(strip_usage=True, on_text=out.add_text)
    for event in (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"he"}}]}\n\n',
        b'data: {"choices":[{"index":1,"delta":{"content":"ignored"}}]}\n\n',
        b'data: {"choices":[{"index":0,"text":"llo"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ):
        observer.observe(event)
    assert out.joined == "hello" and observer.done


@pytest.mark.parametrize(
    ("ticks", "tokens", "itl"),
    [
        ([0.0, 0.1, 0.2, 0.3], 4, 0.1),  # one token a chunk
        ([0.0, 0.3], 4, 0.1),  # several tokens a chunk: the mean over the tokens
        ([0.0], 4, None),  # one chunk: no gap between tokens seen
        ([0.0, 0.1], 1, None),
        ([], 0, None),
    ],
)
def test_mean_inter_token_latency(ticks, tokens, itl) -> None:
    clock = TokenClock()
    for t in ticks:
        clock.tick(t)
    assert clock.itl(tokens) == (pytest.approx(itl) if itl is not None else None)
