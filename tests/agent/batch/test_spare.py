"""The spare-capacity gate: table tests and a property (never more than the room, nothing
while anyone waits or a cache is full)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.gateway.batch.spare import Spare, spare_lines
from fleet_base.batch.config import BatchConfig
from fleet_base.protocol import ReplicaLoad

CONFIG = BatchConfig(per_replica=4, max_kv_usage=0.8)
IDLE = ReplicaLoad()


def load(waiting: int = 0, kv: float = 0.0, running: int = 0) -> ReplicaLoad:
    return ReplicaLoad(waiting=waiting, kv_cache_usage=kv, running=running)


@pytest.mark.parametrize(
    ("loads", "in_flight", "queued", "expected"),
    [
        ([], 0, 0, Spare(0, "no_replica")),
        ([IDLE], 0, 0, Spare(4, "spare")),
        ([IDLE, IDLE], 0, 0, Spare(8, "spare")),
        ([IDLE, IDLE], 3, 0, Spare(5, "spare")),
        ([IDLE, IDLE], 8, 0, Spare(0, "full")),
        ([IDLE], 9, 0, Spare(0, "full")),  # more in flight than room (replicas went away)
        ([IDLE, load(waiting=1)], 0, 0, Spare(0, "engine_queue")),
        ([IDLE, load(kv=0.8)], 0, 0, Spare(0, "kv_cache")),  # at the bound: closed
        ([IDLE, load(kv=0.79, running=50)], 0, 0, Spare(8, "spare")),  # busy but nobody waits
        ([IDLE, IDLE], 0, 1, Spare(0, "gateway_queue")),
        ([load(waiting=3, kv=0.95)], 0, 2, Spare(0, "gateway_queue")),
    ],
)
def test_the_gate(loads: list[ReplicaLoad], in_flight: int, queued: int, expected: Spare) -> None:
    assert spare_lines(loads, in_flight, queued, CONFIG) == expected


loads_st = st.lists(
    st.builds(
        ReplicaLoad,
        waiting=st.one_of(st.just(0), st.integers(0, 1000)),
        kv_cache_usage=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
        running=st.integers(0, 1000),
    ),
    max_size=8,
)


@given(
    loads=loads_st,
    in_flight=st.integers(0, 100),
    queued=st.integers(0, 5),
    per_replica=st.integers(0, 16),
    kv=st.floats(0.05, 1.0),
)
def test_never_past_the_room_and_closed_by_any_pressure(
    loads: list[ReplicaLoad], in_flight: int, queued: int, per_replica: int, kv: float
) -> None:
    config = BatchConfig(per_replica=per_replica, max_kv_usage=kv)
    out = spare_lines(loads, in_flight, queued, config)
    assert 0 <= out.lines <= max(0, per_replica * len(loads) - in_flight)
    pressure = queued > 0 or any(r.waiting > 0 or r.kv_cache_usage >= kv for r in loads)
    if pressure or not loads:
        assert out.lines == 0
    else:
        assert out.lines == max(0, per_replica * len(loads) - in_flight)
    assert (out.lines > 0) == (out.reason == "spare")
