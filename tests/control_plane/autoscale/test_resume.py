"""The autoscaler's memory survives a change of leader: each policy's state round-trips
through its stored form and decides on exactly as the live one would, and an autoscale
loop started on the database of one stopped mid-burst-memory makes the decisions the
uninterrupted loop makes (a fresh memory does not: the test can fail)."""

from __future__ import annotations

import copy
import math

import pytest
from sqlalchemy import delete, select

from control_plane.autoscale import AutoscaleSettings, Observation, ScalerState, make_policy
from control_plane.autoscale.burst import BurstMemory
from control_plane.autoscale.slo import SloMemory
from control_plane.autoscale.snapshot import dump, dump_cycles, load, resumed, snapshot
from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.loops.autoscale import LISTEN_S, AutoscaleLoop
from control_plane.loops.autoscale_store import SAVE_S, read_states
from control_plane.settings import Settings
from fleet_base.profile import load_profile
from fleet_base.protocol import Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus
from tests.control_plane.autoscale.helpers import series
from tests.control_plane.autoscale.test_slo import Work

H100 = load_profile("llama2-70b-h100-tp4")
QUIET = Work(0.5, 1500, 30)
BURST = Work(16.0, 3500, 30)
# Quiet, a burst, a lull (the memory holds for the burst), another burst, a long lull.
TRACE = series(
    (0, 300, QUIET), (300, 320, BURST), (320, 420, QUIET), (420, 440, BURST), (440, 900, QUIET)
)  # fmt: skip


def observation(t: float, w: Work, current: int) -> Observation:
    return Observation(
        at=t,
        in_flight=w.rps * (0.1 + w.output * 0.04),
        ready=current,
        current=current,
        requests_per_s=w.rps,
        prompt_tokens_per_s=w.rps * w.prompt,
        output_tokens_per_s=w.rps * w.output,
        prompt_sample=(w.prompt,) * 4,
    )


def drive(policy: str, state: ScalerState, trace, current: int = 1):
    s = AutoscaleSettings(profile=H100, max_replicas=40, target_concurrency=64.0, policy=policy)
    p, out = make_policy(policy), []
    for t, w in trace:
        d = p.decide(s, state, observation(t, w, current))
        out.append((t, d.desired, d.reason))
        current = d.desired
    return out, current


@pytest.mark.parametrize("policy", ["ours", "planner", "kpa", "concurrency"])
def test_each_policys_state_round_trips_and_decides_on_the_same(policy: str) -> None:
    cut = next(i for i, (t, _) in enumerate(TRACE) if t >= 360)  # in the lull after the first burst
    live = ScalerState()
    _, current = drive(policy, live, TRACE[:cut])
    text, cycles = dump(live, TRACE[cut - 1][0]), dump_cycles(live)
    back = load(text, cycles)
    assert dump(back.state(), back.at) == text  # nothing lost or changed on the way
    assert dump_cycles(back.state()) == cycles
    assert back == load(back.model_dump_json())
    if policy == "ours":
        assert '"seasons"' not in text and '"daily"' in cycles and load(text).cycles == {}  # apart
    if policy == "ours":  # the memory that matters is there: a burst and its windows
        mem = back.state().memory["ours"]
        assert isinstance(mem, SloMemory) and isinstance(mem.burst, BurstMemory)
        assert mem.burst.open is not None or mem.burst.bursts
        assert mem.burst.windows and mem.seasons.daily.slots
    ahead_live, _ = drive(policy, copy.deepcopy(live), TRACE[cut:], current)
    ahead_back, _ = drive(policy, back.state(), TRACE[cut:], current)
    assert ahead_back == ahead_live


def test_infinite_times_survive_json() -> None:
    state = ScalerState()  # panic_until and last_demand_at start at -inf
    back = load(dump(state, 5.0)).state()
    assert back.panic_until == -math.inf and back.last_demand_at == -math.inf and back.first_at is None


def test_a_gap_longer_than_the_window_blocks_scale_down_for_a_full_window_again() -> None:
    live = ScalerState()
    drive("kpa", live, series((0, 120, Work(8.0, 1000, 200))))
    snap = snapshot(live, 118.0)
    assert resumed(snap, 150.0, 60.0).first_at == live.first_at  # a short gap: the windows carry on
    late = resumed(snap, 118.0 + 61.0, 60.0)
    assert late.first_at is None and late.recent  # blind: a fresh window, the held counts kept
    # with no demand at all after the gap, it holds its replicas for one window, then drops
    out, _ = drive("kpa", late, series((180, 300, Work(0.0, 1000, 200))), current=10)
    assert all(d == 10 for t, d, _ in out if t < 240) and out[-1][1] < 10


# --------------------------------------------------------------------- the loop, on a database

REPLICAS = 8  # placed and ready throughout: the decisions differ only by what is remembered


def _database(tmp_path, name: str):
    url = f"sqlite:///{tmp_path / name}"
    upgrade_to_head(url)
    sessions = make_sessions(url)
    with sessions() as s:
        c = m.Cluster(id="c1", region="r1", status="healthy", load={})
        c.pools = [m.CapacityPool(name="h", gpu_model="H100", gpus_per_node=8, nodes=8, hourly_price=72.0)]
        d = m.Deployment(name="chat", replicas=1, current_version=1)
        d.versions = [
            m.DeploymentVersion(
                version=1, model="llama2-70b", gpu_count=4, min_replicas=1, max_replicas=20,
                target_concurrency=64.0, scale_down_delay_s=0.0,
                engine_args={"profile": "llama2-70b-h100-tp4"},
            )
        ]  # fmt: skip
        s.add_all([c, d])
        s.flush()
        s.add_all(
            m.ReplicaAssignment(replica_id=f"r{i}", deployment_id=d.id, version=1, cluster_id="c1", state="ready")
            for i in range(REPLICAS)
        )  # fmt: skip
        s.commit()
    return sessions


def _loop(tmp_path, sessions) -> AutoscaleLoop:
    return AutoscaleLoop(
        ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions), policy="ours"
    )


def _tick(loop: AutoscaleLoop, t: float, w: Work) -> tuple[int, str]:
    share = 1.0 / REPLICAS
    load = ReplicaLoad(
        running=int(w.rps * (0.1 + w.output * 0.04) * share),
        requests_per_s=w.rps * share,
        prompt_tokens_per_s=w.rps * w.prompt * share,
        tokens_per_s=w.rps * w.output * share,
    )
    loop.heartbeats["c1"] = Heartbeat(cluster="c1", sent_at=t, replicas=[
        ReplicaStatus(replica_id=f"r{i}", deployment="chat", version=1, state=ReplicaState.ready, load=load)
        for i in range(REPLICAS)])  # fmt: skip
    loop.tick(t)
    d = loop.last["chat"]
    return d.desired, d.reason


def test_a_new_leader_resumes_the_burst_memory_and_decides_as_the_old_one_would(tmp_path) -> None:
    t0 = 1_800_000_000.0  # the seasonal slots are by time of day: a real clock's values
    trace = [(t0 + t, w) for t, w in TRACE if t < 560]
    whole = _database(tmp_path, "whole.db")
    uninterrupted = _loop(tmp_path, whole)
    expected = [_tick(uninterrupted, t, w) for t, w in trace]

    shared = _database(tmp_path, "shared.db")
    old = _loop(tmp_path, shared)
    # the old leader dies right after a store, in the lull after the first burst
    cut = next(i for i, (t, _) in enumerate(trace) if t >= t0 + 360 and t - old._saved_at >= SAVE_S)
    got = [_tick(old, t, w) for t, w in trace[: cut + 1]]
    assert old._saved_at == trace[cut][0]
    with shared() as s:
        stored = read_states(s)
    ((policy, snap),) = stored.values()
    assert policy == "ours" and snap.at == trace[cut][0] and snap.cycles["ours"].daily.slots
    new = _loop(tmp_path, shared)
    got += [_tick(new, t, w) for t, w in trace[cut + 1 :]]
    assert new.resumed == 1
    assert got == expected
    held = [d for (t, _), (d, _) in zip(trace, expected, strict=True) if t0 + 330 <= t < t0 + 420]
    assert min(held) > 1  # the memory held replicas through the lull: there was something to lose

    # Control: the same takeover without the stored memory decides otherwise.
    with shared() as s:
        s.execute(delete(m.AutoscalerState))
        s.execute(m.Deployment.__table__.update().values(replicas=expected[cut][0]))
        s.commit()
    fresh = _loop(tmp_path, shared)
    again = [_tick(fresh, t, w) for t, w in trace[cut + 1 :]]
    assert fresh.resumed == 0 and again != expected[cut + 1 :]
    for sessions in (whole, shared):
        sessions.kw["bind"].dispose()


def test_a_new_leader_decides_nothing_until_it_hears_the_clusters_its_replicas_are_on(tmp_path) -> None:
    sessions = _database(tmp_path, "blind.db")
    loop = _loop(tmp_path, sessions)
    t0 = 1_800_000_000.0
    loop.tick(t0)  # no heartbeat yet: its 8 replicas would look idle
    assert "chat" not in loop.last and "chat" not in loop.states
    _tick(loop, t0 + 2, QUIET)
    assert "chat" in loop.last
    # a cluster that stays silent past LISTEN_S no longer holds the decision back
    late = _loop(tmp_path, sessions)
    late.tick(t0)
    late.tick(t0 + LISTEN_S)
    assert "chat" in late.last
    with sessions() as s:
        assert s.scalar(select(m.Deployment.replicas)) >= 1
    sessions.kw["bind"].dispose()
