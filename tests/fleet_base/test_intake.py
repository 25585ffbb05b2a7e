"""Per-sender budgets and the size cap, checked before a message is parsed (`fleet_base.intake`)."""

from __future__ import annotations

from fleet_base.intake import Intake, SenderBudget
from tests.agent.gateway.test_units import Clock


def test_a_sender_over_its_budget_is_refused_and_others_are_not() -> None:
    clock = Clock()
    budget = SenderBudget(messages_per_s=10, bytes_per_s=1000, burst_s=1.0, clock=clock)
    assert all(budget.admit("west", 10) for _ in range(10))
    assert not budget.admit("west", 10)  # 10 messages a second, spent
    assert budget.admit("east", 10)
    assert not budget.admit("east", 1001)  # more bytes than a second's worth
    clock.t = 0.5
    assert budget.admit("west", 10)  # half a second refilled half
    for i in range(2000):
        budget.admit(f"c{i}", 1)
    assert len(budget) == budget.max_senders


def test_intake_refuses_by_length_then_by_the_senders_budget() -> None:
    clock = Clock()
    intake = Intake(100, messages_per_s=1, bytes_per_s=1000, clock=clock)
    intake.budget.burst_s = 1.0
    assert intake.refusal("fleet.v1.heartbeat.west", b"x" * 101) == "size"
    assert intake.refusal("fleet.v1.heartbeat.west", b"x") is None
    assert intake.refusal("fleet.v1.heartbeat.west", b"x") == "rate"
    assert intake.refusal("fleet.v1.heartbeat.east", b"x") is None  # its own budget
