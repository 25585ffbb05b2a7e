"""The reconcile policy, table-driven: desired + records + now -> actions."""

from __future__ import annotations

import pytest

from agent.reconciler import ReplicaRecord, Restart, Start, Stop, backoff_delay, plan
from fleet_base.protocol import DesiredState, ReplicaSpec, ReplicaState

S = ReplicaState


def spec(rid: str, dep: str = "chat", version: int = 1, **engine_args: object) -> ReplicaSpec:
    return ReplicaSpec(replica_id=rid, deployment=dep, version=version, model="m", engine_args=engine_args)


def rec(rid: str, state: ReplicaState, dep: str = "chat", version: int = 1, **kw: object) -> ReplicaRecord:
    return ReplicaRecord(replica_id=rid, spec=spec(rid, dep, version), state=state, **kw)  # type: ignore[arg-type]


def want(*specs: ReplicaSpec) -> DesiredState:
    return DesiredState(cluster="c1", generation=1, replicas=list(specs))


NOW = 100.0

CASES = [
    # (name, desired, records, expected actions)
    ("nothing desired, nothing running", want(), [], []),
    ("start a missing replica", want(spec("a")), [], [Start(spec("a"))]),
    ("start two, keep one", want(spec("a"), spec("b")), [rec("a", S.ready)], [Start(spec("b"))]),
    ("steady state", want(spec("a")), [rec("a", S.ready)], []),
    ("starting replica is left alone", want(spec("a")), [rec("a", S.starting)], []),
    ("stop a removed replica", want(), [rec("a", S.ready)], [Stop("a", "not desired")]),
    ("stop a removed starting replica", want(), [rec("a", S.starting)], [Stop("a", "not desired")]),
    ("forget a removed failed replica", want(), [rec("a", S.failed)], [Stop("a", "not desired")]),
    ("draining replica is not stopped twice", want(), [rec("a", S.draining)], []),
    (
        "scale down keeps the wanted one",
        want(spec("a")),
        [rec("a", S.ready), rec("b", S.ready)],
        [Stop("b", "replaced")],
    ),
    (
        "restart a crashed replica after its backoff",
        want(spec("a")),
        [rec("a", S.failed, restarts=1, failed_at=90.0, next_restart_at=99.0)],
        [Restart("a", spec("a"))],
    ),
    (
        "crashed replica waits for its backoff",
        want(spec("a")),
        [rec("a", S.failed, failed_at=99.5, next_restart_at=101.0)],
        [],
    ),
    (
        "a refused spec is never restarted",
        want(spec("a")),
        [rec("a", S.failed, failed_at=1.0, next_restart_at=None)],
        [],
    ),
    (
        "same id, changed spec: stop first (started again once gone)",
        want(spec("a", max_num_seqs=4)),
        [rec("a", S.ready)],
        [Stop("a", "spec changed")],
    ),
    (
        "same id, changed spec, still draining: wait",
        want(spec("a", max_num_seqs=4)),
        [rec("a", S.draining)],
        [],
    ),
    (
        "new version surges: old kept while new starts",
        want(spec("b", version=2)),
        [rec("a", S.ready)],
        [Start(spec("b", version=2))],
    ),
    (
        "new version starting: old still kept",
        want(spec("b", version=2)),
        [rec("a", S.ready), rec("b", S.starting, version=2)],
        [],
    ),
    (
        "new version ready: old drained",
        want(spec("b", version=2)),
        [rec("a", S.ready), rec("b", S.ready, version=2)],
        [Stop("a", "replaced")],
    ),
    (
        "new version crashed: old keeps serving",
        want(spec("b", version=2)),
        [rec("a", S.ready), rec("b", S.failed, version=2, next_restart_at=200.0)],
        [],
    ),
    (
        "old version not ready gives no capacity: stopped at once",
        want(spec("b", version=2)),
        [rec("a", S.starting), rec("b", S.starting, version=2)],
        [Stop("a", "replaced")],
    ),
    (
        "two old, one new ready: keep one old for the missing second",
        want(spec("c", version=2), spec("d", version=2)),
        [rec("a", S.ready), rec("b", S.ready), rec("c", S.ready, version=2), rec("d", S.starting, version=2)],
        [Stop("b", "replaced")],
    ),
    (
        "deployment removed entirely: all stopped",
        want(spec("x", dep="other")),
        [rec("a", S.ready), rec("x", S.ready, dep="other")],
        [Stop("a", "not desired")],
    ),
    (
        "surge is per deployment",
        want(spec("b", version=2), spec("y", dep="other")),
        [rec("a", S.ready), rec("x", S.ready, dep="other")],
        [Start(spec("b", version=2)), Start(spec("y", dep="other"))],
    ),
]


@pytest.mark.parametrize(("name", "desired", "records", "expected"), CASES, ids=[c[0] for c in CASES])
def test_plan(name: str, desired: DesiredState, records: list[ReplicaRecord], expected: list) -> None:
    assert plan(desired, records, NOW) == expected


def test_no_desired_state_stops_nothing_but_restarts_crashes() -> None:
    records = [rec("a", S.ready), rec("b", S.failed, next_restart_at=50.0)]
    assert plan(None, records, NOW) == [Restart("b", spec("b"))]


def test_plan_is_deterministic_and_idempotent_on_input_order() -> None:
    desired = want(spec("c", version=2), spec("d", version=2))
    records = [rec("a", S.ready), rec("b", S.ready), rec("c", S.ready, version=2)]
    assert plan(desired, records, NOW) == plan(desired, list(reversed(records)), NOW)


@pytest.mark.parametrize(
    ("streak", "expected"), [(0, 0.0), (1, 0.5), (2, 1.0), (3, 2.0), (5, 8.0), (6, 10.0), (200, 10.0)]
)
def test_backoff_doubles_up_to_the_cap(streak: int, expected: float) -> None:
    assert backoff_delay(streak, 0.5, 10.0) == expected
