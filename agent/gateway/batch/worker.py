"""The batch worker: runs the work items of the deployments this gateway serves, only in
spare capacity (`spare`), through the gateway's own request path (`Gateway.run_work`).

One loop per deployment: it asks the gate how many lines may start, pulls that many from
the store (priority 0, then 1, then 2) and runs each as a task of its own. A line:
- whose result is already stored (a re-delivery after a crash) is acknowledged, not run
  again (and so not booked twice; its usage record id is the line's in any case);
- of a batch that is cancelling, cancelled or expired (the record read afresh right
  before the line starts), or an async request no longer queued, is acknowledged unrun;
- past its `not_after` is stored expired;
- else runs, its hold on the item renewed every third of the ack wait. A run that failed
  with a 5xx past the gateway's own retries, or a 429, is put back with backoff up to
  `line_attempts`, then its failure is its result; a 4xx is the line's answer.
A result is stored (create-once) before the item is acknowledged; an async request's record
is finished (and its webhook queued) in between. The run's usage record (its id the line's)
is booked only when this run's result is the one stored: a run the worker retries, or one
that lost the create to another run or to the driver's `batch_expired` placeholder, books
nothing, so a line's usage records equal its output lines. The loop also reads the deployment's
backlog for the metrics and as autoscaler demand (scale from zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.gateway.batch.async_api import async_expired_line, finish_async_record
from agent.gateway.batch.metrics import LineMetrics
from agent.gateway.batch.spare import Spare
from agent.gateway.batch.work import WorkOutcome, retried
from fleet_base.batch import names
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import (
    LineError,
    LineResponse,
    LineResult,
    StoredResult,
    WorkItem,
    now,
)
from fleet_base.batch.store import BatchStore, Conflict, Delivery, NotFound
from fleet_base.protocol import UsageRecord

log = logging.getLogger(__name__)

DROPPED = frozenset({"cancelling", "cancelled", "expired", "failed"})  # a batch's items not to run
BACKLOG_EVERY_S = 2.0
BACKOFF_MAX_S = 60.0
PULL_TIMEOUT_S = 0.2

RunWork = Callable[[WorkItem, str], Awaitable[WorkOutcome]]


@dataclass(frozen=True)
class WorkerHooks:
    """What the worker takes from its gateway."""

    run: RunWork  # `Gateway.run_work`
    deployments: Callable[[], list[str]]  # those this gateway serves
    spare: Callable[[str, int], Spare]  # (deployment, lines in flight here) -> the gate's answer
    backlog: Callable[[str, int], None]  # the store's backlog of a deployment, as demand
    cluster: str
    book: Callable[[UsageRecord], None] = lambda record: None  # publish a usage record


def line_backoff_s(attempt: int, config: BatchConfig) -> float:
    return min(BACKOFF_MAX_S, config.line_backoff_s * 2 ** max(0, attempt - 1))


def line_id(item: WorkItem) -> str:
    """The output line's `id`: a batch line's stable one; an async request's own id."""
    return item.parent_id if item.index is None else names.line_request_id(item.parent_id, item.index)


def answered(item: WorkItem, outcome: WorkOutcome, request_id: str) -> LineResult:
    response = LineResponse(status_code=outcome.status, request_id=request_id, body=outcome.body)
    return LineResult(id=line_id(item), custom_id=item.custom_id, response=response)


def expired(item: WorkItem) -> LineResult:
    if item.kind == "batch":
        error = LineError(
            code="batch_expired",
            message="This request could not be executed before the completion window expired.",
        )
    else:
        return async_expired_line(item.parent_id)
    return LineResult(id=line_id(item), custom_id=item.custom_id, error=error)


class BatchWorker:
    def __init__(
        self,
        config: BatchConfig,
        hooks: WorkerHooks,
        metrics: LineMetrics,
        *,
        tick_s: float = 0.5,
        clock: Callable[[], float] = now,
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.metrics = metrics
        self.tick_s = tick_s
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ loops

    async def run(self, store: BatchStore) -> None:
        """A loop per deployment served here, started and stopped as the set changes."""
        loops: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                served = set(self.hooks.deployments())
                for dep in served - loops.keys():
                    self.metrics.know(dep)
                    loops[dep] = asyncio.create_task(self._deployment(store, dep), name=f"batch-worker-{dep}")
                for dep in loops.keys() - served:
                    loops.pop(dep).cancel()
                await asyncio.sleep(self.tick_s * 4)
        finally:
            for task in [*loops.values(), *self._tasks]:
                task.cancel()

    async def _deployment(self, store: BatchStore, dep: str) -> None:
        backlog_at = -1e9
        while True:
            try:
                if time.monotonic() - backlog_at >= BACKLOG_EVERY_S:
                    backlog_at = time.monotonic()
                    backlog = await store.pending(dep)
                    self.metrics.queued.labels(dep).set(backlog)
                    self.hooks.backlog(dep, backlog)
                if not await self.pull_once(store, dep):
                    await asyncio.sleep(self.tick_s)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the store away: try again, the lines wait on the queue
                log.warning("batch worker for %s: %s: %s", dep, type(err).__name__, err)
                await asyncio.sleep(max(self.tick_s, 1.0))

    async def pull_once(self, store: BatchStore, dep: str) -> int:
        """Pull what the gate allows and start each line; the number started."""
        gate = self.hooks.spare(dep, self.in_flight.get(dep, 0))
        started = 0
        for priority in names.PRIORITIES:
            want = gate.lines - started
            if want <= 0:
                break
            for delivery in await store.pull(dep, priority, want, PULL_TIMEOUT_S):
                self._start(store, dep, delivery)
                started += 1
        return started

    def _start(self, store: BatchStore, dep: str, delivery: Delivery) -> None:
        self.in_flight[dep] = self.in_flight.get(dep, 0) + 1
        self.metrics.in_flight.labels(dep).inc()
        task = asyncio.create_task(self._line(store, dep, delivery), name=f"batch-line-{delivery.item.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _line(self, store: BatchStore, dep: str, delivery: Delivery) -> None:
        try:
            await self.handle(store, delivery)
        except asyncio.CancelledError:  # the gateway stops: the item comes back after its ack wait
            raise
        except Exception:
            log.exception("batch line %s failed in the worker; put back", delivery.item.id)
            with contextlib.suppress(Exception):
                await delivery.nak(line_backoff_s(delivery.attempt, self.config))
        finally:
            self.in_flight[dep] -= 1
            self.metrics.in_flight.labels(dep).dec()

    # ------------------------------------------------------------------ one line

    async def handle(self, store: BatchStore, delivery: Delivery) -> None:
        item = delivery.item
        dep = item.deployment
        stored = await store.result(item.id)
        if stored is not None:  # ran before (its worker died before the ack): not again
            if item.kind == "async":  # its record may not have been finished then
                await self._finish_async(store, item, stored.line)
            await delivery.ack()
            return
        if await self._dropped(store, item):
            await delivery.ack()
            return
        if self.clock() > item.not_after:
            line = expired(item)
            if await store.put_result(item.id, StoredResult(line=line, cluster=self.hooks.cluster)):
                self.metrics.failed.labels(dep).inc()
            if item.kind == "async":
                await self._finish_async(store, item, line, "expired")
            await delivery.ack()
            return
        if delivery.attempt == 1:
            self.metrics.queue_s.labels(dep).observe(max(0.0, self.clock() - item.enqueued_at))
        if item.kind == "async":
            await self._started_async(store, item)
        request_id = f"req-{secrets.token_hex(12)}"
        outcome = await self._run_held(delivery, request_id)
        if retried(outcome.status) and delivery.attempt < self.config.line_attempts:
            self.metrics.retried.labels(dep).inc()
            await delivery.nak(line_backoff_s(delivery.attempt, self.config))
            return
        line = answered(item, outcome, request_id)
        result = StoredResult(
            line=line,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cluster=self.hooks.cluster,
        )
        if await store.put_result(item.id, result):
            (self.metrics.completed if line.ok else self.metrics.failed).labels(dep).inc()
            if outcome.record is not None:
                self.hooks.book(outcome.record)
        if item.kind == "async":
            await self._finish_async(store, item, line)
        await delivery.ack()

    async def _run_held(self, delivery: Delivery, request_id: str) -> WorkOutcome:
        """The run, the item's hold renewed every third of the ack wait meanwhile."""

        async def hold() -> None:
            while True:
                await asyncio.sleep(self.config.ack_wait_s / 3)
                with contextlib.suppress(Exception):
                    await delivery.in_progress()

        keeper = asyncio.create_task(hold())
        try:
            return await self.hooks.run(delivery.item, request_id)
        finally:
            keeper.cancel()

    async def _dropped(self, store: BatchStore, item: WorkItem) -> bool:
        """A batch no longer running its lines (cancel, expiry), or an async request no
        longer queued (it finished, or was cancelled)."""
        if item.kind == "async":
            try:
                record = (await store.async_request(item.parent_id)).value
            except NotFound:
                return True
            return record.status not in ("queued", "in_progress")
        try:  # read afresh: a line must not start after its batch's cancel was stored
            status = (await store.batch(item.parent_id)).value.status
        except NotFound:
            status = "cancelled"  # gone: nobody will read its lines
        return status in DROPPED

    async def _started_async(self, store: BatchStore, item: WorkItem) -> None:
        """The async request is in progress (best effort: its end is what matters)."""
        with contextlib.suppress(NotFound, Conflict):
            current = await store.async_request(item.parent_id)
            if current.value.status == "queued":
                started = current.value.model_copy(
                    update={"status": "in_progress", "started_at": int(self.clock())}
                )
                await store.update_async(started, current.revision)

    async def _finish_async(
        self, store: BatchStore, item: WorkItem, line: LineResult, status: str = ""
    ) -> None:
        status = status or async_status(line)
        await finish_async_record(store, item.parent_id, status, self.config, self.clock())  # type: ignore[arg-type]


def async_status(line: LineResult) -> str:
    """An async request's status from its stored result: an expired one stays expired."""
    if line.error is not None and line.error.code == "expired":
        return "expired"
    return "succeeded" if line.ok else "failed"
