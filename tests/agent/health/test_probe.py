"""The correctness probe's policy: when to probe, what counts as a wrong answer."""

from __future__ import annotations

from agent.health.probe import ProbeTracker, Verdict
from fleet_base.cluster_config import HealthConfig

S = HealthConfig(probe_idle_s=30, probe_busy_s=300)
A, B = (1, 2, 3), (9, 9, 9)


def test_schedule_idle_busy_and_suspect() -> None:
    t = ProbeTracker(S)
    assert t.due("r1", "d@1", 0.0, busy=False)  # never probed: at once
    assert t.observe("r1", "d@1", A, 0.0) == Verdict.baseline
    assert not t.due("r1", "d@1", 29.0, busy=False)
    assert t.due("r1", "d@1", 30.0, busy=False)
    assert not t.due("r1", "d@1", 299.0, busy=True)
    assert t.due("r1", "d@1", 300.0, busy=True)
    assert t.observe("r1", "d@1", B, 31.0) == Verdict.suspect
    assert t.due("r1", "d@1", 31.0, busy=True)  # a suspect is probed again at once


def test_one_mismatch_is_suspect_two_confirm() -> None:
    t = ProbeTracker(S)
    t.observe("r1", "d@1", A, 0.0)
    assert t.observe("r1", "d@1", B, 30.0) == Verdict.suspect
    assert t.observe("r1", "d@1", A, 31.0) == Verdict.ok  # a blip: cleared
    assert t.observe("r1", "d@1", B, 60.0) == Verdict.suspect
    assert t.observe("r1", "d@1", B, 61.0) == Verdict.wrong
    assert not t.due("r1", "d@1", 1000.0, busy=False)  # condemned: probed no more


def test_peers_of_the_same_version_are_the_reference() -> None:
    t = ProbeTracker(S)
    t.observe("r1", "d@1", A, 0.0)
    t.observe("r2", "d@1", A, 0.0)
    t.observe("r9", "d@2", B, 0.0)  # another version: its own answers
    # a replica wrong from the start: its start-up answer disagrees with its peers
    assert t.observe("r3", "d@1", B, 1.0) == Verdict.suspect
    assert t.observe("r3", "d@1", B, 2.0) == Verdict.wrong
    assert t.expected("r3") == A
    assert t.observe("r9", "d@2", B, 40.0) == Verdict.ok


def test_one_peer_is_no_majority() -> None:
    t = ProbeTracker(S)
    t.observe("r1", "d@1", A, 0.0)
    assert t.observe("r2", "d@1", B, 0.0) == Verdict.baseline  # who is right is unknown
    assert t.observe("r2", "d@1", B, 30.0) == Verdict.ok


def test_text_answers_and_forget() -> None:
    t = ProbeTracker(S)
    t.observe("r1", "d@1", "Paris", 0.0)
    assert t.observe("r1", "d@1", "Pari$", 30.0) == Verdict.suspect
    t.forget({"r2"})
    assert t.replicas == {}
