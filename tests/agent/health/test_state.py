"""Table tests of the node state machine: every transition, thresholds, flapping, and
operators' actions applied once in order."""

from __future__ import annotations

import pytest

from agent.health.classify import Classified, Severity, classified
from agent.health.state import NodePolicy
from fleet_base.cluster_config import HealthConfig
from fleet_base.node_health import FaultKind, NodeAction, NodeFault, NodeState

H, S, C, D, R, X = (
    NodeState.healthy,
    NodeState.suspect,
    NodeState.cordoned,
    NodeState.drained,
    NodeState.remediated,
    NodeState.retired,
)
SETTINGS = HealthConfig(
    soft_faults_to_cordon=3, soft_window_s=100, quiet_s=50, flap_cordons=3, flap_window_s=1000
)


def f(kind: FaultKind, at: float = 0.0, gpu: int | None = 0) -> Classified:
    return classified(NodeFault(node="n1", gpu=gpu, kind=kind, at=at, evidence="e"))


def node(state: NodeState = H, **kw) -> NodePolicy:
    p = NodePolicy(node="n1", settings=SETTINGS, gpus=2, **kw)
    p.state = state
    return p


@pytest.mark.parametrize(
    ("start", "faults", "replicas", "end"),
    [
        (H, [], 1, H),
        (H, [FaultKind.fell_off_bus], 1, C),
        (H, [FaultKind.ecc_uncorrectable], 1, C),
        (H, [FaultKind.retired_pages], 1, C),
        (H, [FaultKind.cuda_error], 1, C),
        (H, [FaultKind.crash_loop], 1, C),
        (H, [FaultKind.wrong_answer], 1, C),
        (H, [FaultKind.thermal], 1, S),
        (H, [FaultKind.stall], 1, S),
        (H, [FaultKind.oom], 1, H),  # not the node's fault
        (H, [FaultKind.stall, FaultKind.thermal], 1, S),
        (H, [FaultKind.stall, FaultKind.thermal, FaultKind.stall], 1, C),  # the Nth soft fault
        (S, [FaultKind.cuda_error], 1, C),
        (H, [FaultKind.cuda_error], 0, D),  # cordoned with nothing on it: drained
        (C, [], 1, C),
        (C, [], 0, D),
        (D, [FaultKind.cuda_error], 0, D),
        (X, [FaultKind.thermal], 0, X),
        (R, [FaultKind.thermal], 1, S),
        (R, [FaultKind.cuda_error], 1, C),
    ],
)
def test_faults(start, faults, replicas, end) -> None:
    p = node(start, since=0.0)
    health, transitions = p.step(10.0, [f(k, 10.0) for k in faults], replicas)
    assert health.state == end
    assert (transitions[-1].new if transitions else start) == end
    assert health.faults == len(faults)
    assert health.gpus_withheld == ([0, 1] if end in (C, D, X) else [])
    if end in (C, D) and start not in (C, D):
        assert health.cordoned_by == "agent"


def test_severity_none_xid_counts_only() -> None:
    p = node()
    app_xid = Classified(NodeFault(node="n1", gpu=0, kind=FaultKind.xid, evidence="Xid 13"), Severity.none)
    health, transitions = p.step(1.0, [app_xid], 1)
    assert (health.state, transitions, health.faults) == (H, [], 1)


def test_soft_faults_outside_window_do_not_add_up() -> None:
    p = node()
    p.step(0.0, [f(FaultKind.stall, 0.0)], 1)
    p.step(40.0, [f(FaultKind.stall, 40.0)], 1)
    health, _ = p.step(120.0, [f(FaultKind.stall, 120.0)], 1)  # 0 fell out of the 100 s window
    assert health.state == S
    health, _ = p.step(130.0, [f(FaultKind.stall, 130.0)], 1)
    assert health.state == C and "3 faults within 100 s" in health.reason


def test_suspect_recovers_after_quiet_period() -> None:
    p = node()
    p.step(0.0, [f(FaultKind.thermal, 0.0)], 1)
    assert p.step(49.0, [], 1)[0].state == S
    health, transitions = p.step(50.0, [], 1)
    assert health.state == H and transitions[0].old == S and "no fault for 50 s" in health.reason


def test_cordon_reason_names_the_gpu_and_evidence() -> None:
    health, transitions = node().step(1.0, [f(FaultKind.fell_off_bus, gpu=1)], 1)
    assert health.reason == "fell_off_bus on GPU 1: e"
    assert [(t.old, t.new) for t in transitions] == [(H, C)]


def test_drained_after_replicas_leave() -> None:
    p = node()
    p.step(1.0, [f(FaultKind.cuda_error)], 2)
    health, transitions = p.step(2.0, [], 0)
    assert health.state == D and [(t.old, t.new) for t in transitions] == [(C, D)]
    assert "cuda_error" in health.reason


def test_flapping_retires() -> None:
    p = node()
    t = 0.0
    for _ in range(2):
        t += 10
        assert p.step(t, [f(FaultKind.cuda_error, t)], 1)[0].state == C
        t += 10
        assert p.step(t, [], 1, [NodeAction(node="n1", action="uncordon", at=t)])[0].state == R
    t += 10
    health, _ = p.step(t, [f(FaultKind.cuda_error, t)], 1)
    assert health.state == X and "cordoned 3 times" in health.reason
    # retired stays out; only an operator brings it back
    assert p.step(t + 5000, [], 0)[0].state == X
    assert p.step(t + 5001, [], 0, [NodeAction(node="n1", action="uncordon", at=t + 5001)])[0].state == R


def test_flapping_outside_window_does_not_retire() -> None:
    p = node()
    for t in (0.0, 600.0, 1200.0):  # cordons 600 s apart, the window is 1000 s: at most 2 in it
        assert p.step(t + 1, [f(FaultKind.cuda_error, t + 1)], 1)[0].state == C
        p.step(t + 2, [], 1, [NodeAction(node="n1", action="uncordon", at=t + 2)])
    assert p.state == R


def test_operator_cordon_and_uncordon_once_in_order() -> None:
    p = node()
    cordon = NodeAction(node="n1", action="cordon", at=5.0, reason="maintenance")
    health, _ = p.step(6.0, [], 1, [cordon])
    assert (health.state, health.cordoned_by, health.reason) == (
        C,
        "operator",
        "cordoned by an operator: maintenance",
    )
    # the same action again (it stays in the desired state) changes nothing
    assert p.step(7.0, [], 1, [cordon])[1] == []
    # an older uncordon and another node's are ignored
    assert p.step(8.0, [], 1, [NodeAction(node="n1", action="uncordon", at=4.0)])[0].state == C
    assert p.step(8.0, [], 1, [NodeAction(node="n2", action="uncordon", at=9.0)])[0].state == C
    # out of order in one list: applied in `at` order, so the later uncordon wins
    both = [
        NodeAction(node="n1", action="uncordon", at=11.0),
        NodeAction(node="n1", action="cordon", at=10.0),
    ]
    health, transitions = p.step(12.0, [], 1, both)
    assert health.state == R and health.cordoned_by == ""
    assert [t.new for t in transitions] == [R]  # the cordon found it cordoned already


def test_operator_cordons_do_not_count_as_flapping() -> None:
    p = node()
    for t in (1.0, 3.0, 5.0, 7.0):
        p.step(t, [], 1, [NodeAction(node="n1", action="cordon", at=t)])
        p.step(t + 1, [], 1, [NodeAction(node="n1", action="uncordon", at=t + 1)])
    assert p.state == R


def test_remediated_heals_on_clean_probe_or_quiet() -> None:
    p = node(R, since=100.0)
    assert p.step(110.0, [], 1)[0].state == R
    assert p.step(111.0, [], 1, clean_probe=True)[0].state == H
    q = node(R, since=100.0)
    assert q.step(149.0, [], 1)[0].state == R
    assert q.step(150.0, [], 1)[0].state == H


def test_drained_node_uncordoned_is_remediated() -> None:
    p = node(D)
    assert p.step(1.0, [], 0, [NodeAction(node="n1", action="uncordon", at=1.0)])[0].state == R
