"""Where one request goes: a pure plan of ordered attempts, each with a reason.

The gateway gathers facts (the request, this cluster's ready replicas and their load,
live peers, the prefix index), calls `plan_route`, and walks the attempts doing the I/O;
`fleetctl simulate` calls the same function on simulated replicas, so simulated and
live routing cannot drift. No I/O, no clock, no randomness here: the canary draw is a
fact of the request.

Stages, in the order the executor walks them:
- ``primary``: this cluster is a warm standby and a primary peer is alive; on failure
  the request falls through to the stages below (served here).
- ``peer``: nothing usable here (no ready replica, all just failed, our agent silent)
  or the queue here is past the spill threshold; final. Nearest first, except that a
  peer whose prefix-cache hit saves more than its extra RTT costs goes first
  ("peer-prefix").

A peer's prefix hits are its own claims (its KV events), which nothing here can check:
they may choose among peers a request goes to anyway, never draw a request away from
local replicas that can serve it. So no stage before ``local`` follows them; a cluster
that advertises blocks it does not hold gains only traffic that was leaving anyway.
- ``local``: this cluster's replicas, best first (the executor takes a queue slot
  first, and re-plans after waiting); an empty ``local`` stage means "wait for a replica".
- ``failover``: peers to try when every local attempt failed before its first byte.

Residency (`fleet_base.residency`) is applied once, to the candidates, before any stage
is built: this cluster is a candidate only when the request's allowed set permits its
jurisdiction, a peer only when it permits the peer's (`Plan.excluded` names the peers it
removed), so no stage, retry or migration (which walks this plan too) can reach outside
the set. When nothing permitted is left the plan is empty and says so
(`Plan.residency_unavailable`): the client is told, the request never moves elsewhere.

What a failure means in each stage (before the first byte: fall through, fail over, give
up; after it: migrate), and who charges the request, is data too (`STAGE_RULES`,
`Attempt.charge`): the executor reads it instead of knowing it. Today a broken stream
migrates in every stage (when the request can be continued: `agent.gateway.migration`).

A request for a LoRA adapter ranks replicas where the adapter is resident first
("adapter-resident"), then those with room to load it ("adapter-load"), then the rest
("adapter-evict": the least recently used adapter there makes room); cost decides within
each tier. A non-resident attempt carries `load_adapter`, which the executor loads first.

Cost model (``CostModel``): the request's expected time to first token at each target, in
seconds, lower is better (`fleet_base.kv_tier_cost.expected_ttft_s`, the scoring the
simulator calls too): the wait before its prefill can start there, plus the prefill that
target's cache does not save, plus RTT for peers. The wait is the prefills this gateway
sent there that have no first token yet, run one after another in the order sent, less
what of them is already done (`ReplicaFacts.wait_s`, from `kv_tier_cost.queue_wait_s`;
unknown: the queued prefill at the replica's rate), plus the step in flight when it has
requests in flight. A new prompt waits behind the prefills ahead of it, not behind
decoding sequences (the engine schedules prefill first), so decode work only breaks ties
(then all outstanding work, then requests in flight). Queued and saved prefill are one
unit, so a holder of the prefix wins exactly while its queue costs less than the
recompute it saves; past that the request goes where it starts soonest, which then holds
the prefix too (hot prefixes gain holders, and among holders the least busy wins). Where
the queued prefill is unknown (`ReplicaFacts.prefill_tokens` None) all outstanding work
counts as queued. Least-load orders by all outstanding work. A prefix the replica holds
in its host-memory tier saves its prefill less the load back: each such token counts
`host_token_value` (0..1) of a device hit, the replica's own (from its profile) or the
model's default. A replica's speed is its profile's (`ReplicaFacts.timing`), else
`CostModel.tokens_per_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from agent.gateway.routing import pick_version, should_spill
from fleet_base.cluster_config import ROUTINGS
from fleet_base.kv_tier_cost import (
    UNKNOWN_HOST_TOKEN_VALUE,
    PrefillTiming,
    PrefixHit,
    expected_ttft_s,
    prefix_hit,
)
from fleet_base.protocol import VersionWeight
from fleet_base.residency import permits

Stage = Literal["primary", "peer", "local", "failover"]
# What it means when every attempt of a stage failed before the client's first byte:
# "next-stage" falls through (served here after all); "failover" goes on to the failover
# stage when nothing answered at all (no status to pass on); "give-up" passes the last
# upstream's answer (or a 502) to the client.
OnFailure = Literal["next-stage", "failover", "give-up"]
# Who charges the key for an attempt's answer: this gateway, or the peer gateway it
# was forwarded to (this one settles its reservation to nothing).
Charge = Literal["here", "elsewhere"]


# What it means when a stream from the stage's target breaks after its first byte:
# "migrate" continues it at the plan's next target (when the request can be continued);
# "give-up" ends it with an in-band error event.
Midstream = Literal["migrate", "give-up"]


@dataclass(frozen=True)
class StageRule:
    on_failure: OnFailure
    midstream: Midstream = "migrate"
    queue: bool = False  # take a slot of this cluster's queue first, re-plan after waiting
    mark_down: bool = False  # the stage's peers all failed: skip them for a while
    after_failure: bool = False  # entered only when an earlier stage asked for failover


STAGE_RULES: dict[Stage, StageRule] = {
    "primary": StageRule("next-stage", mark_down=True),
    "peer": StageRule("give-up"),
    "local": StageRule("failover", queue=True),
    "failover": StageRule("give-up", after_failure=True),
}
MAX_ATTEMPTS = 3  # per stage; the executor allows the third only after unstarted failures


class PrefixLookup(Protocol):
    """What the plan reads of the prefix index: leading blocks a replica holds on its
    device, then those after them in its host tier."""

    def match_tiers(self, cluster: str, replica_id: str, hashes: Sequence[int]) -> tuple[int, int]: ...


@dataclass(frozen=True)
class RequestFacts:
    deployment: str
    prompt_tokens: int
    cost_tokens: int  # prompt + reserved completion tokens
    forwarded: bool = False  # came from a peer gateway: served here, never sent on
    draw: float = 0.0  # uniform [0, 1): the canary split's draw (sticky per user, else random)
    block_hashes: tuple[int, ...] = ()  # chained prefix-block keys of the prompt
    block_tokens: int = 16  # tokens per block
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)
    allowed: frozenset[str] | None = None  # jurisdictions it may be processed in (None: any)
    local_only: bool = False  # a pipeline hop kept in this cluster: served here, never sent on

    @property
    def stays(self) -> bool:
        """Served here only: no peer, no standby hand-off, no failover."""
        return self.forwarded or self.local_only


@dataclass(frozen=True)
class ReplicaFacts:
    replica_id: str
    url: str
    version: int
    outstanding_tokens: int = 0
    in_flight: int = 0
    recently_failed: bool = False
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded there
    max_adapters: int = 0  # room for adapters (0: LoRA off)
    host_token_value: float | None = None  # a host-tier hit token's worth (0..1); None: the model's
    # Of the outstanding work, the new prefill of requests with no first token yet (what a new
    # prompt waits behind: the engine prefills first); None: unknown, all outstanding work counts.
    prefill_tokens: int | None = None
    # Expected seconds before a new prompt's prefill starts there (`kv_tier_cost.queue_wait_s`
    # over the prefills sent there); None: the queued prefill at the replica's rate.
    wait_s: float | None = None
    # The same for a prompt the engine prefills past long ones (`PrefillTiming.is_short`);
    # None: `wait_s` for every prompt.
    short_wait_s: float | None = None
    timing: PrefillTiming | None = None  # from its profile; None: the cost model's default

    @property
    def queued_prefill(self) -> int:
        return self.outstanding_tokens if self.prefill_tokens is None else self.prefill_tokens

    def expected_wait_s(self, timing: PrefillTiming, new_tokens: float | None = None) -> float:
        """Seconds before a new prompt's prefill (of `new_tokens`, when known) could start:
        the prefill queued ahead of it, then the step in flight."""
        if self.short_wait_s is not None and new_tokens is not None and timing.is_short(new_tokens):
            queued = self.short_wait_s
        elif self.wait_s is None:
            queued = timing.prefill_s(self.queued_prefill)
        else:
            queued = self.wait_s
        return queued + (timing.step_s if self.in_flight else 0.0)


@dataclass(frozen=True)
class PeerFacts:
    cluster: str
    url: str
    standby: bool = False
    rtt_s: float | None = None  # from the routing table; None: unknown
    replica_ids: tuple[str, ...] = ()  # its replicas known to the prefix index
    jurisdiction: str = ""  # from the routing table; "" is outside every residency policy


@dataclass(frozen=True)
class ClusterFacts:
    cluster: str
    replicas: tuple[ReplicaFacts, ...] = ()  # ready replicas of the deployment here
    versions: tuple[VersionWeight, ...] = ()  # the route's canary weights
    standby_here: bool = False
    agent_silent: bool = False  # our own agent stopped heart-beating
    waiting: int = 0  # requests of the deployment queued here
    spill_per_replica: float | None = None
    jurisdiction: str = ""  # this cluster's own (desired state); "" is outside every policy
    coming: bool = False  # replicas here may become ready (starting, or a cold start is due)

    @property
    def usable(self) -> bool:
        """A ready replica here can take the request now (our agent alive, not all just failed)."""
        return (
            bool(self.replicas)
            and not self.agent_silent
            and any(not r.recently_failed for r in self.replicas)
        )


@dataclass(frozen=True)
class CostModel:
    routing: str = "prefix"  # or "least-load"
    tokens_per_s: float = 4000.0  # prefill speed of a replica (or peer) whose profile is unknown
    min_prefix_blocks: int = 1  # a peer must hold at least this many blocks to be preferred
    host_token_value: float = UNKNOWN_HOST_TOKEN_VALUE  # of a replica (or peer) whose profile is unknown

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; known: {', '.join(ROUTINGS)}")

    @property
    def prefix(self) -> bool:
        return self.routing == "prefix"

    @property
    def timing(self) -> PrefillTiming:
        return PrefillTiming(1.0 / self.tokens_per_s)


@dataclass(frozen=True)
class Attempt:
    stage: Stage
    reason: str
    name: str = ""  # replica id or peer cluster; "" for "wait for a replica"
    url: str = ""
    version: int | None = None
    is_peer: bool = False
    standby: bool = False
    cached_tokens: int = 0  # prompt tokens the target need not prefill (prefix index, both tiers)
    host_tokens: int = 0  # of those, the ones loaded back from its host tier
    cost: float = 0.0  # expected seconds to first token there (prefix routing), else outstanding tokens
    load_adapter: str = ""  # a LoRA adapter to load there before sending (not resident)
    jurisdiction: str = ""  # where the target processes the request

    @property
    def rule(self) -> StageRule:
        return STAGE_RULES[self.stage]

    @property
    def charge(self) -> Charge:
        return "elsewhere" if self.is_peer else "here"


@dataclass(frozen=True)
class Plan:
    attempts: tuple[Attempt, ...] = field(default_factory=tuple)
    excluded: tuple[str, ...] = ()  # live peers the request's residency ruled out
    local_excluded: bool = False  # residency rules out this cluster itself
    residency_unavailable: bool = False  # nothing permitted can serve it: refuse, never move

    def stage(self, name: Stage) -> list[Attempt]:
        return [a for a in self.attempts if a.stage == name]

    @property
    def stages(self) -> list[Stage]:
        out: list[Stage] = []
        for a in self.attempts:
            if a.stage not in out:
                out.append(a.stage)
        return out


def cached_tokens(request: RequestFacts, blocks: int) -> int:
    """Prompt tokens a replica holding `blocks` leading blocks need not prefill (the last
    prompt token is always computed, as the engine does)."""
    return prefix_hit(blocks, 0, request.block_tokens, request.prompt_tokens).tokens


def _hit(request: RequestFacts, tiers: tuple[int, int]) -> PrefixHit:
    return prefix_hit(tiers[0], tiers[1], request.block_tokens, request.prompt_tokens)


def _cycle(attempts: list[Attempt], n: int = MAX_ATTEMPTS) -> list[Attempt]:
    """Retries go down the ranking, then around it again (one replica is retried)."""
    if not attempts:
        return []
    picked = [attempts[i % len(attempts)] for i in range(n)]
    return [picked[0], *(replace(a, reason="retry") for a in picked[1:])]


def _peer_attempts(
    stage: Stage,
    reason: str,
    peers: Sequence[PeerFacts],
    request: RequestFacts,
    index: PrefixLookup | None,
    host_value: float = UNKNOWN_HOST_TOKEN_VALUE,
) -> list[Attempt]:
    out = []
    for p in peers:
        hit = _peer_hit(p, request, index, host_value)
        out.append(
            Attempt(
                stage,
                reason,
                p.cluster,
                p.url,
                is_peer=True,
                standby=p.standby,
                cached_tokens=hit.tokens,
                host_tokens=hit.host_tokens,
                jurisdiction=p.jurisdiction,
            )
        )
    return _cycle(out)


def _peer_hit(
    p: PeerFacts, request: RequestFacts, index: PrefixLookup | None, host_value: float
) -> PrefixHit:
    """The peer's best replica for the prompt, by the prefill its tiers save."""
    if index is None or not request.block_hashes:
        return PrefixHit()
    hits = (_hit(request, index.match_tiers(p.cluster, rid, request.block_hashes)) for rid in p.replica_ids)
    return max(hits, key=lambda h: (h.value(host_value), h.device_tokens), default=PrefixHit())


def rank_replicas(
    request: RequestFacts,
    here: ClusterFacts,
    index: PrefixLookup | None,
    model: CostModel,
) -> list[Attempt]:
    """Local replicas best first: the canary's version first, then by cost; replicas that
    just failed last. The first attempt's reason says why it won."""
    if not here.replicas:
        return []
    wanted: int | None = None
    versions = {r.version for r in here.replicas}
    if len(versions) > 1 and here.versions:
        wanted = pick_version(versions, here.versions, request.draw)
    found = []
    for r in here.replicas:
        if request.adapter is not None and r.max_adapters == 0 and request.adapter not in r.adapters:
            continue  # LoRA is off there: it can never serve the adapter
        tiers = (0, 0)
        if model.prefix and index is not None and request.block_hashes:
            tiers = index.match_tiers(here.cluster, r.replica_id, request.block_hashes)
        cached = _hit(request, tiers)
        host_value = model.host_token_value if r.host_token_value is None else r.host_token_value
        found.append((r, cached, host_value, cached.value(host_value)))  # prefill saved, in tokens
    scored = []
    for r, cached, host_value, hit in found:
        if model.prefix:
            timing = r.timing or model.timing
            wait = r.expected_wait_s(timing, request.prompt_tokens - cached.tokens)
            cost = expected_ttft_s(cached, request.prompt_tokens, wait, host_value, timing)
        else:
            cost = float(r.outstanding_tokens)
        tier = adapter_tier(request.adapter, r)
        key = (
            wanted is not None and r.version != wanted,
            r.recently_failed,
            tier,
            cost,
            r.outstanding_tokens,
            r.in_flight,
            r.replica_id,
        )
        scored.append((key, r, hit, cost, cached))
    if not scored:
        return []
    scored.sort(key=lambda s: s[0])
    best_hit = max(s[2] for s in scored if s[0][:3] == scored[0][0][:3])  # among the top's peers
    out = []
    for key, r, hit, cost, cached in scored:
        load = ""
        if request.adapter is not None:
            reason = ADAPTER_REASONS[key[2]]
            load = "" if key[2] == 0 else request.adapter
        elif not model.prefix or best_hit == 0:
            reason = "least-load"
        elif hit == best_hit:
            reason = "prefix"
        elif hit > 0:
            reason = "partial-prefix"
        else:
            reason = "load-over-prefix"  # a replica with more of the prefix is too busy
        out.append(
            Attempt(
                "local",
                reason,
                r.replica_id,
                r.url,
                r.version,
                cached_tokens=cached.tokens,
                host_tokens=cached.host_tokens,
                cost=cost,
                load_adapter=load,
                jurisdiction=here.jurisdiction,
            )
        )
    return _cycle(out)


ADAPTER_REASONS = ("adapter-resident", "adapter-load", "adapter-evict")


def adapter_tier(adapter: str | None, r: ReplicaFacts) -> int:
    """0: resident (or a base-model request), 1: room to load it, 2: an adapter must go."""
    if adapter is None or adapter in r.adapters:
        return 0
    return 1 if len(r.adapters) < r.max_adapters else 2


def plan_route(
    request: RequestFacts,
    here: ClusterFacts,
    peers: Sequence[PeerFacts],
    index: PrefixLookup | None = None,
    model: CostModel | None = None,
) -> Plan:
    """The ordered attempts for one request. `peers` are live peers nearest first (standby
    peers are used only while no permitted primary peer is)."""
    model = model or CostModel()
    here, peers, excluded = within_residency(request, here, peers)
    local_ok = permits(request.allowed, here.jurisdiction)
    refused = Plan(excluded=excluded, local_excluded=not local_ok, residency_unavailable=True)
    local = rank_replicas(request, here, index, model)
    if request.stays:  # served where it lands (or a pipeline's hop): no peers, no standby hand-off
        if not local_ok:
            return refused
        return Plan(tuple(local or [Attempt("local", "wait-for-replica", jurisdiction=here.jurisdiction)]))
    attempts: list[Attempt] = []
    primaries = [p for p in peers if not p.standby]
    if here.standby_here and primaries:
        attempts += _peer_attempts(
            "primary", "standby-primary", primaries, request, index, model.host_token_value
        )
    else:
        usable = here.usable
        spill = should_spill(here.waiting, len(here.replicas), here.spill_per_replica)
        if peers and (not usable or spill):
            if not local_ok:
                reason = "residency"
            else:
                reason = (
                    "no-local-replica" if not here.replicas else ("spill" if usable else "local-unusable")
                )
            return Plan(tuple(_leaving(reason, peers, request, index, model)), excluded, not local_ok)
    if not local_ok or (excluded and not attempts and not here.replicas and not here.coming):
        return refused  # no permitted primary, peer or replica here, nothing coming here
    attempts += local or [Attempt("local", "wait-for-replica", jurisdiction=here.jurisdiction)]
    attempts += plan_failover(request, peers, index, model.host_token_value)
    return Plan(tuple(attempts), excluded)


def within_residency(
    request: RequestFacts, here: ClusterFacts, peers: Sequence[PeerFacts]
) -> tuple[ClusterFacts, list[PeerFacts], tuple[str, ...]]:
    """The candidates the request's residency permits: this cluster's replicas only when
    its jurisdiction is allowed, the permitted peers (standby ones only while no permitted
    primary is left), and the names of the peers ruled out."""
    if not permits(request.allowed, here.jurisdiction):
        here = replace(here, replicas=(), standby_here=False)
    ok = [p for p in peers if permits(request.allowed, p.jurisdiction)]
    excluded = tuple(p.cluster for p in peers if not permits(request.allowed, p.jurisdiction))
    return here, [p for p in ok if not p.standby] or ok, excluded


def plan_failover(
    request: RequestFacts,
    peers: Sequence[PeerFacts],
    index: PrefixLookup | None = None,
    host_value: float = UNKNOWN_HOST_TOKEN_VALUE,
) -> list[Attempt]:
    """Peers to try after every local attempt failed (none for a request that stays here)."""
    if request.stays:
        return []
    return _peer_attempts("failover", "failover", peers, request, index, host_value)


def plan_to_peer(request: RequestFacts, here: ClusterFacts, peer: PeerFacts | None, reason: str) -> Plan:
    """A request sent whole to one chosen peer (a pipeline request to the cluster that
    runs it), within the request's residency; empty when that peer is gone or outside."""
    _, peers, excluded = within_residency(request, here, [peer] if peer is not None else [])
    if not peers:
        return Plan(excluded=excluded, residency_unavailable=bool(excluded))
    return Plan(tuple(_peer_attempts("peer", reason, peers, request, None)), excluded)


def _leaving(
    reason: str,
    peers: Sequence[PeerFacts],
    request: RequestFacts,
    index: PrefixLookup | None,
    model: CostModel,
) -> list[Attempt]:
    """The ``peer`` stage of a request that leaves this cluster: nearest first, unless a
    peer holding at least `min_prefix_blocks` of the prompt costs less, its new prefill
    plus RTT against the nearest's, in which case it goes first ("peer-prefix")."""
    order = list(peers)
    value = model.host_token_value
    if model.prefix and index is not None and request.block_hashes:

        def cost(p: PeerFacts) -> float:
            rtt = p.rtt_s if p.rtt_s is not None else 0.1
            hit = _peer_hit(p, request, index, value)
            return expected_ttft_s(hit, request.prompt_tokens, 0.0, value, model.timing) + rtt

        def blocks(p: PeerFacts) -> int:
            return max(
                (sum(index.match_tiers(p.cluster, rid, request.block_hashes)) for rid in p.replica_ids),
                default=0,
            )

        holders = [p for p in order if blocks(p) >= model.min_prefix_blocks]
        best = min(holders, key=cost, default=None)
        if best is not None and best is not order[0] and cost(best) < cost(order[0]):
            order.remove(best)
            attempts = _peer_attempts("peer", reason, [best, *order], request, index, value)
            return [replace(attempts[0], reason="peer-prefix"), *attempts[1:]]
    return _peer_attempts("peer", reason, order, request, index, value)
