"""The gateway's prefix-cache knowledge: the index of every replica's cached blocks (fed
by `fleet.v1.kvcache.*`, local cluster and peers alike), the request's own block keys
(the engine's chained hashes over the prompt the gateway tokenized already), and the
metrics of what prefix routing saved.

The hashes are the engine's own function (`fleet_base.block_hash`, torch-free), over
the same token ids and cache salt the engine will use, so a key the gateway computes is
the key the engine published. A gap in a replica's sequence numbers asks its agent for
the full set on `fleet.v1.kvresync.<cluster>` (at most once per `RESYNC_EVERY_S`).

What a cluster publishes is judged cheaply before it is parsed: a message longer than
`MAX_BATCH_BYTES`, on a subject that names no cluster, or past its cluster's budget
(`fleet_base.intake`) is dropped and counted in `fleet_gateway_kv_events_dropped_total`
by reason; the index bounds each cluster's replicas and blocks (`kv_index.PrefixIndex`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.gateway.inputs import RequestInfo
from agent.gateway.kv_index import KvUpdate, PrefixIndex, block_key
from agent.gateway.metrics import GatewayMetrics, drop_departed
from agent.gateway.plan import Attempt, CostModel
from agent.gateway.tenancy import salt_of
from fleet_base.block_hash import hash_request_blocks
from fleet_base.domain import is_cluster_id
from fleet_base.intake import Intake
from fleet_base.kv_events import (
    ALL_REPLICAS,
    KVCACHE_WILDCARD,
    MAX_BATCH_BYTES,
    KvCacheBatch,
    KvResyncRequest,
    kvresync_subject,
)
from fleet_base.kv_tier_cost import PrefillTiming, load_token_value, long_prefill_timing, profile_timing
from fleet_base.nats_io import NatsLink
from fleet_base.profile import PerfProfile, load_profile
from fleet_base.wire import Rejected, decode_kv_batch, subject_cluster

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # the engine's default (engine.config.EngineArgs.block_size)
RESYNC_EVERY_S = 2.0
MAX_ASKED = 4096  # resync requests remembered (for their pacing)


def prefix_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> tuple[int, ...]:
    """Index keys of a prompt's full blocks, in the engine's chained-hash scheme."""
    return tuple(block_key(h) for h in hash_request_blocks(list(token_ids), block_size, cache_salt))


def to_update(batch: KvCacheBatch) -> KvUpdate:
    ops = tuple(
        (op.kind, tuple(block_key(bytes.fromhex(h)) for h in op.block_hashes), op.tier) for op in batch.ops
    )
    return KvUpdate(
        batch.cluster,
        batch.replica_id,
        batch.deployment,
        batch.epoch,
        batch.seq,
        ops,
        snapshot=batch.snapshot,
        block_size=batch.block_size,
    )


class _IndexCollector(Collector):
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(
            "fleet_gateway_prefix_index_blocks", "Block hashes the prefix index holds, all replicas."
        )
        g.add_metric([], self.index.size)
        yield g


class PrefixRouting:
    """Index + cost model + the NATS feed that keeps the index current."""

    def __init__(
        self,
        link: NatsLink | None,
        cluster: str,
        metrics: GatewayMetrics,
        *,
        routing: str = "prefix",
        tokens_per_s: float = 4000.0,
        max_blocks: int = 65536,
        max_cluster_replicas: int = 256,
        max_cluster_blocks: int = 262144,
        events_per_s: float = 1000.0,
        event_bytes_per_s: float = 2 * 1024 * 1024,
        engine_arg: Callable[[str, str], Any] = lambda deployment, name: None,
        clusters: Callable[[], Iterable[str]] = tuple,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.cluster = cluster
        self.index = PrefixIndex(
            max_blocks_per_replica=max_blocks,
            max_replicas_per_cluster=max_cluster_replicas,
            max_blocks_per_cluster=max(max_blocks, max_cluster_blocks),
        )
        self.intake = Intake(MAX_BATCH_BYTES, events_per_s, event_bytes_per_s, clock=clock)
        self.model = CostModel(routing=routing, tokens_per_s=tokens_per_s)
        self.engine_arg = engine_arg
        self.clusters = clusters  # whose replicas' full sets to ask for on (re)connect
        self.clock = clock
        self._asked: dict[tuple[str, str], float] = {}
        self._profiles: dict[str, PerfProfile | None] = {}  # by name; None: could not be read
        self._nc: object | None = None
        r = metrics.registry
        self.decisions = Counter(
            "fleet_gateway_routing_decisions", "Attempts by the routing plan's reason for them.",
            ["deployment", "reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "fleet_gateway_prefix_prompt_tokens", "Prompt tokens of requests sent to a replica.",
            ["deployment", "replica"], registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "fleet_gateway_prefix_cached_tokens",
            "Of those, tokens the replica held in its prefix cache (prefill saved), per the index.",
            ["deployment", "replica"], registry=r,
        )  # fmt: skip
        self.host_tokens = Counter(
            "fleet_gateway_prefix_host_tokens",
            "Of the cached tokens, those in the replica's host-memory tier (loaded back, not prefilled).",
            ["deployment", "replica"], registry=r,
        )  # fmt: skip
        self.events = Counter(
            "fleet_gateway_kv_events", "KV-event batches received, by outcome (applied, stale, resync, invalid).",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.dropped = Counter(
            "fleet_gateway_kv_events_dropped",
            "KV-event messages dropped before indexing, by reason (size, sender, rate, or the "
            "decoder's: malformed, subject, schema, invalid).",
            ["reason"], registry=r,
        )  # fmt: skip
        r.register(_IndexCollector(self.index))
        if link is not None:
            link.on_connect(self._on_connect)

    # ------------------------------------------------------------------ per request

    def block_tokens(self, deployment: str) -> int:
        size = self.index.block_size(deployment) or self.engine_arg(deployment, "block_size")
        return size if isinstance(size, int) and size > 0 else DEFAULT_BLOCK_SIZE

    def host_token_value(self, deployment: str) -> float | None:
        """A host-tier hit token's worth on the deployment's replicas, from the performance
        profile its engine args name (`profile`); None when they name none (the cost model's
        default then)."""
        profile = self._profile(deployment)
        return None if profile is None else load_token_value(profile)

    def timing(self, deployment: str) -> PrefillTiming | None:
        """The deployment's replicas' prefill speed, from the same profile, with the
        long-prefill cap its engine args set (the engine's flag; none: off, the engine's
        default, whatever the profile assumed); None: unknown."""
        profile = self._profile(deployment)
        if profile is None:
            return None
        threshold = _count(self.engine_arg(deployment, "long_prefill_token_threshold")) or 0
        budget = _count(self.engine_arg(deployment, "max_num_batched_tokens")) or profile.max_prefill_tokens
        return long_prefill_timing(profile_timing(profile), threshold, budget)

    def _profile(self, deployment: str) -> PerfProfile | None:
        name = self.engine_arg(deployment, "profile")
        if not isinstance(name, str) or not name:
            return None
        if name not in self._profiles:
            try:
                self._profiles[name] = load_profile(name)
            except (ValueError, OSError) as err:
                log.warning("profile %r of %s: %s; routing takes the default speeds", name, deployment, err)
                self._profiles[name] = None
        return self._profiles[name]

    def keys(self, info: RequestInfo, key_id: str, salted: bool = True) -> tuple[int, ...]:
        """The request's block keys; () when routing ignores prefixes or the prompt was
        not tokenized (estimated counts have no ids). `salted`: the deployment's engine
        takes the key's cache salt (else its blocks, and so their events, have none)."""
        ids = info.prompt_ids
        if not self.model.prefix or not ids:
            return ()
        # the salt the replica gets (agent.gateway.tenancy)
        return prefix_keys(ids, self.block_tokens(info.deployment), salt_of(key_id, salted))

    def keep_replicas(self, live: set[str]) -> None:
        """Drop the per-replica series of replicas the cluster no longer runs."""
        for metric in (self.prompt_tokens, self.cached_tokens, self.host_tokens):
            drop_departed(metric, "replica", live)

    def count(self, info: RequestInfo, target: Attempt) -> None:
        """An attempt's routing decision and the prefix it found, on /metrics."""
        deployment = info.deployment
        self.decisions.labels(deployment, target.reason).inc()
        if not target.is_peer:
            self.prompt_tokens.labels(deployment, target.name).inc(info.prompt_tokens)
            self.cached_tokens.labels(deployment, target.name).inc(target.cached_tokens)
            self.host_tokens.labels(deployment, target.name).inc(target.host_tokens)

    # ------------------------------------------------------------------ the feed

    async def _on_connect(self) -> None:
        link = self.link
        if link is not None and link.nc is not None and self._nc is not link.nc:
            self._nc = link.nc
            await link.subscribe(KVCACHE_WILDCARD, self._on_message)
            # Whatever was missed while away: every known cluster's replicas, in full.
            for cluster in sorted(set(self.clusters())):
                request = KvResyncRequest(cluster=cluster, replica_id=ALL_REPLICAS, requester=self.cluster)
                await link.publish(kvresync_subject(cluster), request)

    def admit(self, subject: str, data: bytes) -> KvCacheBatch | None:
        """The batch, or None (counted) when it is dropped: cheap checks on the length and
        the sender's budget first, the parse and the subject/identity match after."""
        reason = (
            "sender" if not is_cluster_id(subject_cluster(subject)) else self.intake.refusal(subject, data)
        )
        if reason is None:
            try:  # a claim about another cluster's replicas is refused too
                return decode_kv_batch(subject, data)
            except Rejected as err:
                self.events.labels("invalid").inc()
                reason = err.reason
        self.dropped.labels(reason).inc()
        return None

    async def _on_message(self, msg: Any) -> None:
        batch = self.admit(msg.subject, msg.data)
        if batch is None:
            return
        outcome = self.apply(batch)
        if outcome == "resync":
            await self.ask_resync(batch.cluster, batch.replica_id)

    def apply(self, batch: KvCacheBatch) -> str:
        outcome = self.index.apply(to_update(batch))
        self.events.labels(outcome).inc()
        return outcome

    async def ask_resync(self, cluster: str, replica_id: str) -> None:
        now = self.clock()
        key = (cluster, replica_id)
        if now - self._asked.get(key, -RESYNC_EVERY_S) < RESYNC_EVERY_S or self.link is None:
            return
        if len(self._asked) >= MAX_ASKED:  # forget the paced-out ones, then the oldest
            self._asked = {k: t for k, t in self._asked.items() if now - t < RESYNC_EVERY_S}
            while len(self._asked) >= MAX_ASKED:
                del self._asked[next(iter(self._asked))]
        self._asked.pop(key, None)
        self._asked[key] = now
        request = KvResyncRequest(cluster=cluster, replica_id=replica_id, requester=self.cluster)
        await self.link.publish(kvresync_subject(cluster), request)


def _count(value: object) -> int | None:
    """An engine arg that should be a positive count (a number or its digits, as the engine's
    flag takes either), or None."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
