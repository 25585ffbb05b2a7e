"""The agent's reconcile policy: desired replicas + current replicas + now -> actions.

Pure and synchronous (no I/O, no clock of its own), so the daemon, `fleetctl simulate`
and table tests run the same decisions. The daemon executes the actions through a
`Runtime` and feeds the results back as `ReplicaRecord`s on the next pass.

Rules, in order:
- a wanted replica id with no record is started;
- a record whose spec differs from the wanted spec under the same id is stopped first and
  started again once gone (the id is the identity of a process; no surge possible);
- a failed wanted replica is restarted when its backoff has elapsed (`next_restart_at`;
  None means never, e.g. a spec the runtime refused);
- replicas no longer wanted are stopped, except that ready ones are kept while their
  deployment has fewer ready wanted replicas than it wants: a new version (new
  replica ids) surges in and the old one drains only once the new one serves. If the
  new version never becomes ready the old one keeps serving; rolling back is the
  control plane's call.
- without any desired state (first start, nothing on disk) nothing is stopped: adopted
  replicas keep serving until the control plane speaks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from fleet_base.protocol import DesiredState, ReplicaSpec, ReplicaState

# States in which a replica still counts as running (not being stopped, not gone).
ACTIVE = (ReplicaState.pending, ReplicaState.starting, ReplicaState.ready, ReplicaState.failed)


@dataclass(frozen=True)
class ReplicaRecord:
    """What the reconciler needs to know about one replica the agent runs."""

    replica_id: str
    spec: ReplicaSpec
    state: ReplicaState
    restarts: int = 0
    failed_at: float | None = None
    next_restart_at: float | None = None


@dataclass(frozen=True)
class Start:
    spec: ReplicaSpec

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id


@dataclass(frozen=True)
class Stop:
    """Drain (SIGTERM, bounded) then forget the replica."""

    replica_id: str
    reason: str


@dataclass(frozen=True)
class Restart:
    """Start a crashed replica again under the same id."""

    replica_id: str
    spec: ReplicaSpec


Action = Start | Stop | Restart


def backoff_delay(streak: int, base_s: float, max_s: float) -> float:
    """Seconds before restart number `streak` (1 = first crash): base * 2^(streak-1), capped."""
    if streak <= 0:
        return 0.0
    return min(max_s, base_s * math.pow(2.0, min(streak - 1, 60)))


def plan(desired: DesiredState | None, records: Sequence[ReplicaRecord], now: float) -> list[Action]:
    """The actions that move `records` toward `desired`; deterministic order."""
    actions: list[Action] = []
    restarts = [
        Restart(r.replica_id, r.spec)
        for r in records
        if r.state == ReplicaState.failed and r.next_restart_at is not None and now >= r.next_restart_at
    ]
    if desired is None:
        return restarts

    wanted = {spec.replica_id: spec for spec in desired.replicas}
    by_id = {r.replica_id: r for r in records}

    for spec in desired.replicas:
        if spec.replica_id not in by_id:
            actions.append(Start(spec))

    for r in records:
        spec = wanted.get(r.replica_id)
        if spec is None or r.state not in ACTIVE:
            continue
        if r.spec.model_copy(update={"adapters": spec.adapters}) != spec:  # adapters apply live
            actions.append(Stop(r.replica_id, "spec changed"))
        elif any(x.replica_id == r.replica_id for x in restarts):
            actions.append(Restart(r.replica_id, spec))

    want_count: dict[str, int] = defaultdict(int)
    for spec in desired.replicas:
        want_count[spec.deployment] += 1
    ready_wanted: dict[str, int] = defaultdict(int)
    for r in records:
        if r.state == ReplicaState.ready and wanted.get(r.replica_id) == r.spec:
            ready_wanted[r.spec.deployment] += 1

    unwanted = sorted(
        (r for r in records if r.replica_id not in wanted and r.state in ACTIVE),
        key=lambda r: (r.spec.deployment, r.state != ReplicaState.ready, r.replica_id),
    )
    kept: dict[str, int] = defaultdict(int)
    for r in unwanted:
        dep = r.spec.deployment
        shortfall = want_count[dep] - ready_wanted[dep]
        if r.state == ReplicaState.ready and kept[dep] < shortfall:
            kept[dep] += 1
            continue
        reason = "replaced" if want_count[dep] else "not desired"
        actions.append(Stop(r.replica_id, reason))
    return actions
