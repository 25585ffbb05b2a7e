"""Peer liveness (heard on NATS, failed forwards) and the sticky canary draw: pure parts
with a fake clock."""

from __future__ import annotations

import json

import pytest

from agent.gateway.errors import GatewayError
from agent.gateway.inputs import parse_request
from agent.gateway.liveness import LivenessBook, sticky_draw
from agent.gateway.routing import pick_version
from fleet_base.protocol import VersionWeight


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silence_kills_a_peer_only_while_we_listen():
    clock = Clock()
    book = LivenessBook(dead_after_s=1.8, down_for_s=5, clock=clock)
    book.seen("east")
    clock.now += 10
    assert book.alive("east")  # not listening (NATS down): judge nothing, cached routes stand
    book.listening(True)
    assert book.alive("east")  # just connected: give it time to be heard
    clock.now += 1.0
    book.seen("east")
    clock.now += 1.7
    assert book.alive("east") and not book.silent("east")
    clock.now += 0.2
    assert not book.alive("east") and book.silent("east")
    assert book.alive("never-heard")  # only the routes name it: trust them
    assert not book.silent("never-heard")
    book.seen("east")
    assert book.alive("east")
    book.listening(False)
    clock.now += 60
    assert book.alive("east") and not book.silent("east")  # a partition: keep serving from cache


def test_a_failed_forward_marks_a_peer_down_for_a_while_even_if_heard():
    clock = Clock()
    book = LivenessBook(dead_after_s=1.8, down_for_s=5, clock=clock)
    book.listening(True)
    book.mark_down("west")
    book.seen("west")  # its agent still beats, but its gateway refused us
    assert not book.alive("west")
    clock.now += 5.1
    book.seen("west")
    assert book.alive("west")


def _user(body: dict) -> str | None:
    """The end user as the gateway's typed request reads it."""
    return parse_request(json.dumps({"model": "m", "prompt": "p", **body}).encode(), "completions").user


def test_sticky_draw_is_fixed_per_user_and_spread_across_users():
    a = sticky_draw("alice", None)
    assert a == sticky_draw("alice", "other")
    assert sticky_draw(None, "s-1") == sticky_draw(None, "s-1")
    assert sticky_draw(None, None) is None
    assert _user({"user": "u"}) == "u"
    with pytest.raises(GatewayError):  # a user that is no string never reaches the draw
        _user({"user": 7})
    draws = [sticky_draw(f"u{i}", None) for i in range(2000)]
    assert all(0 <= d < 1 for d in draws)
    weights = [VersionWeight(version=2, weight=0.1), VersionWeight(version=1, weight=0.9)]
    canary = sum(pick_version({1, 2}, weights, d) == 2 for d in draws)
    assert 140 <= canary <= 260  # ~10% of users
    # users on the canary at 10% stay on it at 50% (canary listed first)
    wider = [VersionWeight(version=2, weight=0.5), VersionWeight(version=1, weight=0.5)]
    assert all(pick_version({1, 2}, wider, d) == 2 for d in draws if pick_version({1, 2}, weights, d) == 2)


class FakeLink:
    def __init__(self) -> None:
        self.is_connected = True
        self.callbacks = []

    def on_connect(self, callback) -> None:
        self.callbacks.append(callback)


def test_a_dropped_link_stops_judging_our_own_agent_too():
    from agent.gateway.liveness import PeerLiveness

    clock = Clock()
    link = FakeLink()
    book = PeerLiveness(link, dead_after_s=1.8, clock=clock)  # type: ignore[arg-type]
    book.listening(True)
    clock.now += 2
    book.seen("here")
    clock.now += 3
    assert book.silent("here")
    link.is_connected = False  # a partition: the silence is ours, not the agent's
    assert not book.silent("here") and book.alive("here")
