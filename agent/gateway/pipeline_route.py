"""Where one hop of a pipeline request goes: served here, sent whole to a peer cluster, or
refused with a reason. A pure function of facts the gateway gathers (the pipeline, which of
its steps have a healthy replica here, the peers where every step is ready, the request's
headers); no I/O, no clock, no randomness: a new pipeline request's id is minted by the
caller when the decision says so.

A pipeline request is served in one cluster, its owner, which the id it is given
(`X-Fleet-Pipeline-Request`) names, so every later hop, whichever gateway the client
reaches, goes to that cluster's replicas of its step and no other (docs/pipelines.md,
"Routing"):

- a new request (no id, or an id that names no cluster) is served here when every step is
  ready here, else forwarded whole to the nearest peer where every step is, else served
  here when every step is placed here (replicas starting or scaled to zero: it queues, its
  demand wakes them), else refused;
- a later hop owned here stays here while its step has a healthy replica here (it queues
  rather than spill), or while no peer is ready and its step is placed here (a cold
  start); else it is refused so the client restarts the pipeline request, which then
  fails over whole;
- a later hop owned by another cluster goes there while every step is ready there (refused
  otherwise: serving it elsewhere would split the pipeline); the owner honours the id only
  for the key it minted it for (`agent.gateway.pipelines.MintedIds`), so an invented id
  cannot pick the cluster of a first hop where the pipeline is not ready;
- a peer gateway's forward is served where it lands, as every forward is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fleet_base.domain import CLUSTER_ID_PATTERN
from fleet_base.pipelines import PIPELINE_HEADER, PIPELINE_REQUEST_HEADER, PIPELINE_STEP_HEADER, PipelineSpec

Action = Literal["local", "forward", "refuse"]
Outcome = Literal["local", "forwarded", "refused"]
OUTCOMES: tuple[Outcome, ...] = ("local", "forwarded", "refused")

MAX_REQUEST_ID = 128
_ID_TAIL = re.compile(r"^[0-9a-f]{8,64}$")
_CLUSTER = re.compile(CLUSTER_ID_PATTERN)


def request_id_for(cluster: str, token: str) -> str:
    """A pipeline request's id: its owner cluster, then a random tail (`token`, hex)."""
    return f"{cluster}.{token}"


def owner_of(request_id: str | None) -> str | None:
    """The cluster a pipeline request id names, or None: no id, or one this gateway did not
    shape (the hop is then treated as a new pipeline request)."""
    if not request_id or len(request_id) > MAX_REQUEST_ID:
        return None
    cluster, dot, tail = request_id.rpartition(".")
    if not dot or not _CLUSTER.match(cluster) or not _ID_TAIL.match(tail):
        return None
    return cluster


@dataclass(frozen=True)
class PipelineFacts:
    pipeline: PipelineSpec
    step: str  # the step this hop calls
    here: str  # this cluster
    ready_here: frozenset[str]  # the pipeline's deployments with a healthy ready replica here
    ready_peers: tuple[str, ...] = ()  # live permitted peers where every step is ready, nearest first
    live_peers: frozenset[str] = frozenset()  # live permitted peers serving this hop's step
    request_id: str | None = None  # the X-Fleet-Pipeline-Request header
    forwarded: bool = False  # a peer gateway's forward: served here
    placed_here: bool = False  # every step is placed here (replicas starting or scaled to zero)
    permitted_here: bool = True  # the request's residency permits processing it here
    standby_here: bool = False  # this cluster is a warm standby of some step
    standby_peers: frozenset[str] = frozenset()  # peers that are a warm standby of some step

    @property
    def deployment(self) -> str:
        step = self.pipeline.step(self.step)
        assert step is not None
        return step.deployment

    @property
    def _steps_here(self) -> bool:
        return self.permitted_here and set(self.pipeline.deployments) <= self.ready_here

    @property
    def _primary_ready(self) -> bool:
        """A cluster that is no standby is ready for the pipeline, here or at a peer."""
        here = self._steps_here and not self.standby_here
        return here or any(p not in self.standby_peers for p in self.ready_peers)

    @property
    def ready(self) -> bool:
        """Every step has a healthy ready replica here, the request may be processed here,
        and this cluster is no standby while a primary cluster is ready (as plain requests)."""
        return self._steps_here and not (self.standby_here and self._primary_ready)

    @property
    def peers(self) -> tuple[str, ...]:
        """The ready peers a new request may go to: standby ones only while no primary is ready."""
        if not self._primary_ready:
            return self.ready_peers
        return tuple(p for p in self.ready_peers if p not in self.standby_peers)

    @property
    def cold_here(self) -> bool:
        """Ready nowhere, placed here: served here once the cold start is done."""
        return self.placed_here and self.permitted_here and not self.ready_peers


@dataclass(frozen=True)
class PipelineDecision:
    action: Action
    reason: str
    peer: str = ""  # the cluster a forward goes to
    request_id: str = ""  # the id the hop carries; "" with `mint`: the caller mints one here
    mint: bool = False
    message: str = ""  # why a refusal: for the client

    @property
    def outcome(self) -> Outcome:
        return {"local": "local", "forward": "forwarded", "refuse": "refused"}[self.action]  # type: ignore[return-value]


def decide(f: PipelineFacts) -> PipelineDecision:
    """The hop's route (module docstring)."""
    owner = owner_of(f.request_id)
    carried = f.request_id if owner is not None else ""
    step_here = f.deployment in f.ready_here
    if f.forwarded:  # sent here whole, or a later hop sent to its owner: never on
        if owner is None:
            return PipelineDecision("local", "forwarded-in", mint=True)
        return (
            PipelineDecision("local", "forwarded-in", request_id=carried)
            if step_here or f.cold_here
            else _step_down(f, carried)
        )
    if owner is None:  # a new pipeline request
        if f.ready:
            return PipelineDecision("local", "ready-here", mint=True)
        if f.peers:
            return PipelineDecision("forward", "not-ready-here", peer=f.peers[0])
        if f.cold_here:  # queues here; its demand wakes the steps scaled to zero
            return PipelineDecision("local", "placed-here", mint=True)
        missing = [s.name for s in f.pipeline.steps if s.deployment not in f.ready_here]
        why = (
            f"its residency does not permit {f.here}"
            if not f.permitted_here
            else f"no healthy replica of step(s) {', '.join(missing)}"
        )
        return PipelineDecision(
            "refuse",
            "not-ready-anywhere",
            message=(
                f"Pipeline '{f.pipeline.name}' is not ready in this cluster ({f.here}: {why}) nor "
                "in any permitted peer cluster where every step is ready; retry shortly"
            ),
        )
    if owner == f.here:
        return (
            PipelineDecision("local", "hop-here", request_id=carried)
            if step_here or f.cold_here
            else _step_down(f, carried)
        )
    if owner in f.ready_peers:  # the owner checks that it minted the id for this key
        return PipelineDecision("forward", "hop-to-owner", peer=owner, request_id=carried)
    return PipelineDecision(
        "refuse",
        "owner-unreachable",
        request_id=carried,
        message=(
            f"Pipeline request {carried} is served in cluster {owner}, which this gateway ({f.here}) "
            f"cannot reach now or where the pipeline is not ready; restart the pipeline request without {PIPELINE_REQUEST_HEADER} so "
            "it runs whole in a cluster where every step is ready"
        ),
    )


def _step_down(f: PipelineFacts, carried: str) -> PipelineDecision:
    return PipelineDecision(
        "refuse",
        "step-down",
        request_id=carried,
        message=(
            f"Pipeline '{f.pipeline.name}' step '{f.step}' (deployment '{f.deployment}') has no "
            f"healthy replica in cluster {f.here}, where this pipeline request runs; restart the "
            f"pipeline request without {PIPELINE_REQUEST_HEADER} so it runs whole in a cluster "
            "where every step is ready"
        ),
    )


def ready_peers(
    pipeline: PipelineSpec, order: Sequence[str], ready_in: dict[str, frozenset[str]]
) -> tuple[str, ...]:
    """The peers in `order` (nearest first) where every step's deployment is ready
    (`ready_in`: deployment -> clusters whose routes say it has ready replicas)."""
    return tuple(c for c in order if all(c in ready_in.get(d, frozenset()) for d in pipeline.deployments))


@dataclass(frozen=True)
class PipelineHop:
    """A request's place in a pipeline, fixed when it is admitted: what the routing plan,
    the usage record, the metrics, the trace and a forward to a peer carry."""

    pipeline: str
    step: str
    decision: PipelineDecision
    request_id: str = ""  # the pipeline request's id ("" while a peer mints it)

    @property
    def local_only(self) -> bool:
        return self.decision.action == "local"

    def headers(self) -> dict[str, str]:
        """What a forward to a peer gateway carries, so the peer routes the hop the same way."""
        out = {PIPELINE_HEADER: self.pipeline, PIPELINE_STEP_HEADER: self.step}
        if self.request_id:
            out[PIPELINE_REQUEST_HEADER] = self.request_id
        return out
