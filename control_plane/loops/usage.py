"""Usage from gateways into the database, and each key's per-cluster budget shares.

- ingest: the `FLEET_USAGE` stream (one `UsageRecord` per finished request) through a
  durable consumer, acknowledged after the commit, each record stored once (by its
  `record_id`), so what was sent while the control plane was down arrives when it is
  back and a redelivery never double-counts; a malformed record is counted and skipped;
- shares: every `interval_s`, for each key with a token limit, each cluster's demand in
  the last `window_s` (tokens it admitted, from the stored records, plus tokens it refused
  with 429, kept in memory only: a new leader or a restarted control plane reads the last
  `window_s` of them back from the stream, each once by its record id) -> `compute_shares`
  -> `api_keys.shares`; a change wakes the reconcile loop, which republishes `fleet_keys`
  and so the gateways' shares.

- scope: a record is counted only for a key that exists and, when it carries tokens or a
  version, a deployment placed on its sender, dated no further ahead than
  FLEET_REPORT_CLOCK_SKEW_S (default 300) and no older than the retention
  (`control_plane.report_scope`); others are counted as refused and dropped;
- retention: records older than FLEET_USAGE_RETENTION_DAYS (default 90), and not of the
  current month, are deleted by the scheduled retention job (`control_plane.scheduled`);
  a record dated in the future, which pruning would never reach, is refused on the way in.

Settings come from the process's `Settings` (FLEET_QUOTA_SHARE_INTERVAL_S, FLEET_QUOTA_SHARE_WINDOW_S,
FLEET_QUOTA_MIN_SHARE) so tests can shorten them. Database work runs in threads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select

from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db.models import ApiKey, Cluster, UsageRecord
from control_plane.db.once import insert_once
from control_plane.db.prune import prune_before
from control_plane.fleet_model.shares import ShareSettings, compute_shares
from control_plane.loops.durable import DurableConsumer, Received, Verdicts
from control_plane.loops.store import store_batch
from control_plane.nats_loop import NatsLoop
from control_plane.report_scope import TimeWindow, usage_refusal, usage_scope
from control_plane.settings import Settings
from control_plane.stream_replay import replay
from fleet_base import protocol
from fleet_base.wire import Rejected, decode_usage

log = logging.getLogger(__name__)


def share_settings(settings: Settings) -> ShareSettings:
    """The quota-share policy's settings from the process's `Settings`."""
    return ShareSettings(
        interval_s=settings.quota_share_interval_s,
        window_s=settings.quota_share_window_s,
        min_share=settings.quota_min_share,
    )


def token_limited(quotas: dict) -> bool:
    if quotas.get("tokens_per_minute") or quotas.get("tokens_per_day"):
        return True
    per = quotas.get("deployments") or {}
    return any(
        isinstance(d, dict) and (d.get("tokens_per_minute") or d.get("tokens_per_day")) for d in per.values()
    )


def _values(r: protocol.UsageRecord, seq: int | None = None) -> dict:
    return {
        "at": datetime.fromtimestamp(r.at, timezone.utc),
        "cluster": r.cluster,
        "key_id": r.key_id,
        "deployment": r.deployment,
        "version": r.version,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "status": r.status,
        "latency_s": r.latency_s,
        "ttft_s": r.ttft_s,
        "adapter": r.adapter,
        "region": r.region,
        "jurisdiction": r.jurisdiction,
        "record_id": r.record_id or (f"js-{seq}" if seq else None),
        "shadow": r.shadow,
        "shadow_of": r.shadow_of,
        "itl_s": r.itl_s,
        "greedy_match": r.greedy_match,
        "first_diff_token": r.first_diff_token,
        "pipeline": r.pipeline,
        "pipeline_step": r.pipeline_step,
        "pipeline_request": r.pipeline_request,
        "batch": r.batch,
    }


def store_records(sessions, records: list[protocol.UsageRecord]) -> int:
    """Store records, each once (by `record_id`); the number newly stored."""
    n = 0
    with sessions() as session:
        for r in records:
            values = _values(r)
            if values["record_id"] is None:
                session.add(UsageRecord(**values))
                n += 1
            else:
                n += insert_once(session, UsageRecord, values, "record_id")
        session.commit()
    return n


def report_window(settings: Settings | None = None) -> TimeWindow:
    """The dates a usage record may carry: up to the clock skew ahead, back to the retention."""
    fields = Settings.model_fields
    skew = settings.report_clock_skew_s if settings else fields["report_clock_skew_s"].default
    days = settings.usage_retention_days if settings else fields["usage_retention_days"].default
    return TimeWindow(skew_s=skew, max_age_s=days * 86400.0)


def store_usage_batch(
    sessions,
    batch: list[Received],
    rejections: Rejections,
    on_refused=None,
    window: TimeWindow | None = None,
) -> Verdicts:
    """A batch from the usage stream (`store_batch`), stored once by record id; a retried
    attempt is no request and a refusal is demand, not usage (handed to `on_refused`):
    neither is stored. A record beyond its sender's scope (`report_scope.usage_refusal`)
    is counted and dropped."""
    window = window or report_window()
    now = time.time()
    with sessions() as session:
        scope = usage_scope(session, datetime.fromtimestamp(now - window.max_age_s, timezone.utc))
        places = {cid: (region or "", jur or "") for cid, region, jur in session.execute(
            select(Cluster.id, Cluster.region, Cluster.jurisdiction)).all()}  # fmt: skip

    def values(record: protocol.UsageRecord, seq: int | None = None) -> dict:
        """Where a served request was processed is the control plane's own record of its
        sender (a served record's cluster is where its replica ran: `usage_refusal`), not
        what the sender claims; a differing claim is logged."""
        out = _values(record, seq)
        served = record.prompt_tokens or record.completion_tokens or record.version is not None
        if served and record.cluster in places:
            known = places[record.cluster]
            if (record.region, record.jurisdiction) != known:
                log.warning(
                    "usage from %s says it was processed in %r/%r; recorded as %r/%r (its registration)",
                    record.cluster, record.region[:64], record.jurisdiction[:64], *known,
                )  # fmt: skip
            out["region"], out["jurisdiction"] = known
        return out

    def keep(record: protocol.UsageRecord) -> bool:
        if record.attempt_failed:
            return False
        verdict = usage_refusal(record, scope, window, now)
        if verdict is not None:
            rejections.refuse("usage", verdict.reason, f"from {record.cluster}: {verdict.detail}")
            return False
        if record.refused_tokens > 0:
            if on_refused is not None and not record.shadow:  # a copy's refusal is no key's demand
                on_refused(record)
            return False
        return True

    return store_batch(
        sessions,
        batch,
        rejections,
        pattern=protocol.USAGE_WILDCARD,
        decode=decode_usage,
        table=UsageRecord,
        key="record_id",
        values=values,
        refused=(Exception,),
        keep=keep,
    )


def prune_records(sessions, before: datetime) -> int:
    """Delete the usage records dated before `before` (in batches); the number deleted.
    The scheduled retention job (`control_plane.scheduled.retention`) calls it."""
    return prune_before(sessions, UsageRecord, before)


def update_shares(
    sessions, settings: ShareSettings, now: datetime, refused: dict[str, dict[str, float]] | None = None
) -> list[str]:
    """Recompute every token-limited key's shares from admitted tokens (stored) plus
    `refused` (key -> cluster -> tokens refused in the window); the keys whose shares changed."""
    with sessions() as session:
        keys = [
            k
            for k in session.scalars(select(ApiKey).where(ApiKey.revoked_at.is_(None))).all()
            if token_limited(k.quotas or {})
        ]
        if not keys:
            return []
        clusters = session.scalars(select(Cluster.id).where(Cluster.status != "unhealthy")).all()
        since = now - timedelta(seconds=settings.window_s)
        rows = session.execute(
            select(
                UsageRecord.key_id,
                UsageRecord.cluster,
                func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens),
            )
            .where(
                UsageRecord.at >= since,
                UsageRecord.key_id.in_([k.key_id for k in keys]),
                UsageRecord.shadow.is_(False),  # copies are never counted against the key
            )
            .group_by(UsageRecord.key_id, UsageRecord.cluster)
        ).all()
        usage: dict[str, dict[str, float]] = {}
        for key_id, cluster, tokens in rows:
            usage.setdefault(key_id, {})[cluster] = float(tokens or 0)
        for key_id, per_cluster in (refused or {}).items():
            for cluster, tokens in per_cluster.items():
                usage.setdefault(key_id, {})[cluster] = usage.get(key_id, {}).get(cluster, 0.0) + tokens
        changed = []
        for k in keys:
            new = compute_shares(usage.get(k.key_id, {}), clusters, dict(k.shares or {}), settings)
            if new != dict(k.shares or {}):
                k.shares = new
                changed.append(k.key_id)
        session.commit()
        return changed


class UsageLoop(NatsLoop):
    def __init__(
        self,
        ctx: ControlPlaneContext,
        settings: ShareSettings | None = None,
        rejections: Rejections | None = None,
    ) -> None:
        super().__init__(ctx)
        self.settings = settings or share_settings(ctx.settings)
        self.rejections = rejections or Rejections()
        # (monotonic time, key, cluster, tokens, record id) of refusals within the window
        self._refused: collections.deque[tuple[float, str, str, int, str | None]] = collections.deque()
        self._refused_ids: set[str] = set()  # a refusal replayed and also delivered counts once
        self.refusals_replayed: int | None = None  # None: not yet
        self.consumer: DurableConsumer | None = None

    async def start(self) -> UsageLoop:
        if self.ctx.nats is not None:
            self.consumer = DurableConsumer(
                self.ctx.nats,
                protocol.STREAM_USAGE,
                protocol.USAGE_WILDCARD,
                "control-plane-usage",
                lambda batch: store_usage_batch(
                    self.ctx.sessions,
                    batch,
                    self.rejections,
                    self._on_refused,
                    report_window(self.ctx.settings),
                ),
                ack_wait_s=self.ctx.settings.ingest_ack_wait_s,
            )
            self._spawn(self.consumer.run(), name="cp-usage-ingest")
            self._spawn(self._replay_refused(), name="cp-usage-refusals")
        self._spawn(self._shares_loop(), name="cp-usage-shares")
        await self._listen()
        return self

    async def stop(self) -> None:
        await self._close()  # what was not acknowledged yet stays in the stream

    def _on_refused(self, record: protocol.UsageRecord) -> None:
        """From the store's thread; deque appends are atomic. A refusal replayed from the
        stream after the window (a restart) is no longer demand."""
        age = time.time() - record.at
        if age > self.settings.window_s:
            return
        if record.record_id is not None:
            if record.record_id in self._refused_ids:
                return
            self._refused_ids.add(record.record_id)
        self._refused.append(
            (
                time.monotonic() - max(0.0, age),
                record.key_id,
                record.cluster,
                record.refused_tokens,
                record.record_id,
            )
        )

    async def _replay_refused(self) -> None:
        """The tokens refused in the last `window_s`, read back from the stream once: the
        durable consumer delivers only what nobody acknowledged, and a predecessor's
        memory of them went with it. Through the store's own checks, so a replayed
        refusal counts exactly as a delivered one would."""
        link = self.ctx.nats
        try:
            await link.wait_connected()
            since = time.time() - self.settings.window_s
            batch = []
            async for msg in replay(link.js, protocol.STREAM_USAGE, protocol.USAGE_WILDCARD, since):
                try:
                    usage = decode_usage(msg.subject, msg.data)
                except Rejected:
                    continue
                if usage.refused_tokens > 0:
                    batch.append(Received(msg.subject, msg.data, int(msg.metadata.sequence.stream)))
            if batch:  # its rejections were counted when the durable consumer read them
                window = report_window(self.ctx.settings)
                await asyncio.to_thread(
                    store_usage_batch, self.ctx.sessions, batch, Rejections(), self._on_refused, window
                )
            self.refusals_replayed = len(batch)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the shares follow admitted tokens until new refusals come
            log.warning("replaying refused tokens failed: %s", err)

    def refused(self) -> dict[str, dict[str, float]]:
        """key -> cluster -> tokens refused in the last window_s."""
        horizon = time.monotonic() - self.settings.window_s
        while self._refused and self._refused[0][0] < horizon:
            record_id = self._refused.popleft()[4]
            if record_id is not None:
                self._refused_ids.discard(record_id)
        out: dict[str, dict[str, float]] = {}
        for _, key_id, cluster, tokens, _ in list(self._refused):
            per = out.setdefault(key_id, {})
            per[cluster] = per.get(cluster, 0.0) + tokens
        return out

    async def _shares_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                changed = await asyncio.to_thread(
                    update_shares,
                    self.ctx.sessions,
                    self.settings,
                    datetime.now(timezone.utc),
                    self.refused(),
                )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("updating quota shares failed")
                continue
            if changed:
                log.info("quota shares changed for %d key(s): %s", len(changed), ", ".join(changed[:10]))
                self.ctx.kick()


def initial_shares(session, quotas: dict) -> dict[str, float]:
    """An equal split for a key that just got a token limit, so no region enforces the whole
    budget until the first usage-based split (the next `interval_s`)."""
    if not token_limited(quotas):
        return {}
    clusters = session.scalars(select(Cluster.id).where(Cluster.status != "unhealthy")).all()
    return compute_shares({}, clusters, {}, ShareSettings())
