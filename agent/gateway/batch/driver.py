"""The batch lifecycle driver every gateway runs: it claims batches nobody drives and walks
each through validating -> in_progress -> finalizing -> completed (or failed, expired,
cancelling -> cancelled).

A claim (`DriverClaim`) is taken and renewed by compare-and-set on the record's revision,
renewed at a third of `claim_s`, and taken over by another gateway once it lapses (its
holder died). Every step is resumable from the record alone: validation re-reads the file
and queues every valid line without a result again (the work stream de-duplicates item
ids, a worker skips a line that has a result, and only the run whose result is stored is
booked); `record.enqueued` is a file line index below which no line is answered with an
error here (another gateway's keys and routes judged and queued them). An expiry or a
cancel stores the unfinished lines' results (create-once) before writing the files, so a
line still running loses its result and its booking; the counts come from the record's
total, not the file. The scan also expires queued async requests past their
max_time_in_queue_s (`expire_queued_async`). A step that loses
a compare-and-set re-reads the record and decides again, so a cancel (the API's write)
always wins over the driver's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Literal

from agent.gateway.batch.async_api import expire_queued_async
from agent.gateway.batch.finalize import Unfinished, finalize, tally, unfinished_line
from agent.gateway.batch.metrics import BatchMetrics
from agent.gateway.batch.validate import Validation, validate_file
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import (
    COMPLETION_WINDOWS,
    TERMINAL,
    BatchError,
    BatchErrors,
    BatchRecord,
    DriverClaim,
    FileRecord,
    StoredResult,
    now,
)
from fleet_base.batch.names import new_file_id, result_key
from fleet_base.batch.store import BatchStore, Conflict, NotFound, Versioned
from fleet_base.bounds import MAX_BODY_BYTES

log = logging.getLogger(__name__)

Step = Literal["again", "wait", "done", "lost"]
DeploymentOf = Callable[[str, str], str]  # (key id, model) -> deployment, raising OpenAIError
ENQUEUE_CHUNK = 256
MAX_AGAIN = 8  # steps in a row without a pause
# a cancel stored this long ago is seen by every worker: a worker reads the batch record
# right before a line starts, so only a read just before the cancel can still start one
# (and clocks may run apart a little)
CANCEL_SEEN_S = 3.0


class BatchDriver:
    def __init__(
        self,
        store: BatchStore,
        config: BatchConfig,
        deployment_of: DeploymentOf,
        *,
        holder: str,
        metrics: BatchMetrics | None = None,
        windows: Mapping[str, float] = COMPLETION_WINDOWS,
        tick_s: float = 1.0,
        tally_s: float = 10.0,
        clock: Callable[[], float] = now,
        max_line_bytes: int = MAX_BODY_BYTES,
        refresh: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.config = config
        self.deployment_of = deployment_of
        self.holder = holder
        self.metrics = metrics
        self.windows = windows  # completion_window -> seconds; tests shorten "24h"
        self.tick_s = tick_s  # between two steps of a batch driven here
        self.tally_s = tally_s  # between two readings of a running batch's results
        # between two listings of every batch: a lapsed claim waits claim_s anyway, and a
        # batch created or cancelled here wakes the scan at once
        self.scan_s = max(tick_s, min(5.0, config.claim_s / 3))
        self.clock = clock
        self.max_line_bytes = max_line_bytes
        self.refresh = refresh  # the gateway's keys and routes, reloaded on the loop before validating
        self._active: dict[str, asyncio.Task[None]] = {}
        self._tallied: dict[str, float] = {}  # batch id -> when its results were last read
        self._cancel_seen: dict[str, float] = {}  # batch id -> when this driver first saw it cancelling
        self._wake = asyncio.Event()
        # between two sweeps of the queued async requests past their max_time_in_queue_s
        self.sweep_s = max(self.scan_s, 10.0)
        self._swept = float("-inf")
        self.cluster = holder.split("/", 1)[0]

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        while True:
            try:
                await self.scan()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("batch driver scan failed: %s: %s", type(err).__name__, err)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.scan_s)
            self._wake.clear()

    def wake(self) -> None:
        """Scan now (a batch was created or cancelled here)."""
        self._wake.set()

    async def scan(self) -> None:
        """Start driving every batch that is not over and that nobody else holds."""
        records = await self.store.batches()
        if self.metrics is not None:
            self.metrics.observe(records)
        for record in records:
            if record.terminal or record.id in self._active or not self._claimable(record):
                continue
            self._active[record.id] = asyncio.create_task(self._drive(record.id), name=f"batch-{record.id}")
        if self.clock() - self._swept >= self.sweep_s:
            self._swept = self.clock()
            expired = await expire_queued_async(self.store, self.config, self.clock(), self.cluster)
            if expired:
                log.info("%d queued async requests expired (past max_time_in_queue_s)", expired)

    async def stop(self, release_s: float = 2.0) -> None:
        """Stop driving; hand back the claims held here, so another gateway takes the
        batches over at once instead of when the claims lapse."""
        held = list(self._active)
        tasks = list(self._active.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(self._release(b) for b in held), return_exceptions=True), release_s
            )

    async def _release(self, batch_id: str) -> None:
        v = await self.store.batch(batch_id)
        claim = v.value.claim
        if claim is not None and claim.holder == self.holder and not v.value.terminal:
            await self.store.update_batch(v.value.model_copy(update={"claim": None}), v.revision)

    async def _drive(self, batch_id: str) -> None:
        again = 0
        try:
            while True:
                try:
                    step = await self.step(batch_id)
                except (asyncio.CancelledError, NotFound):
                    raise
                except Exception as err:  # the store down: the claim lapses if it stays down
                    log.warning("driving %s failed (%s: %s); retrying", batch_id, type(err).__name__, err)
                    step = "wait"
                if step in ("done", "lost"):
                    return
                again = again + 1 if step == "again" else 0
                if step == "wait" or again > MAX_AGAIN:  # a record that keeps changing: pause too
                    again = 0
                    await asyncio.sleep(min(self.tick_s, self.config.claim_s / 3))
        except NotFound:
            return
        finally:
            self._active.pop(batch_id, None)
            self._tallied.pop(batch_id, None)
            self._cancel_seen.pop(batch_id, None)

    # ------------------------------------------------------------------ one step

    async def step(self, batch_id: str) -> Step:
        """Read the batch, hold its claim, and move it as far as it can go now."""
        v = await self.store.batch(batch_id)
        if v.value.terminal:
            return "done"
        if not self._claimable(v.value):
            return "lost"
        try:
            v = await self._renew(v)
            status = v.value.status
            if status == "validating":
                return await self._validating(v)
            if status == "in_progress":
                return await self._in_progress(v)
            if status == "finalizing":
                return await self._finish(v, "completed")
            if status == "cancelling":
                return await self._cancelling(v)
        except Conflict:
            return "again"  # someone wrote the record (a cancel, a takeover): read it again
        return "done"

    def _claimable(self, record: BatchRecord) -> bool:
        claim = record.claim
        return claim is None or claim.holder == self.holder or claim.until <= self.clock()

    def _deadline(self, record: BatchRecord) -> float:
        return record.created_at + self.windows.get(record.completion_window, COMPLETION_WINDOWS["24h"])

    async def _renew(self, v: Versioned[BatchRecord]) -> Versioned[BatchRecord]:
        claim = v.value.claim
        if (
            claim is not None
            and claim.holder == self.holder
            and claim.until - self.clock() > self.config.claim_s * 2 / 3
        ):
            return v
        return await self._save(v)

    async def _save(self, v: Versioned[BatchRecord], **changes: object) -> Versioned[BatchRecord]:
        """The record with `changes` and a fresh claim (none once over), by compare-and-set."""
        status = changes.get("status", v.value.status)
        if status != v.value.status:
            changes[f"{status}_at"] = int(self.clock())
        claim = None if status in TERMINAL else self._claim()
        record = v.value.model_copy(update={**changes, "claim": claim})
        saved = await self.store.update_batch(record, v.revision)
        if status != v.value.status:
            log.info("batch %s: %s -> %s", record.id, v.value.status, status)
            if self.metrics is not None:
                self.metrics.transitions.labels(status).inc()
        return saved

    def _claim(self) -> DriverClaim:
        return DriverClaim(holder=self.holder, until=self.clock() + self.config.claim_s)

    # ------------------------------------------------------------------ statuses

    async def _validate(self, record: BatchRecord) -> Validation:
        try:
            data = await self.store.file_content(await self.store.file(record.input_file_id))
        except NotFound:
            missing = BatchError(
                code="file_not_found", message=f"The input file '{record.input_file_id}' no longer exists"
            )
            return Validation(errors=(missing,))
        window = self._deadline(record) - record.created_at
        self.refresh()
        return await asyncio.to_thread(
            validate_file,
            data,
            record,
            self.config,
            lambda model: self.deployment_of(record.key_id, model),
            now=self.clock(),
            window_s=window,
            max_line_bytes=self.max_line_bytes,
        )

    async def _validating(self, v: Versioned[BatchRecord]) -> Step:
        record = v.value
        if self.clock() >= self._deadline(record):
            return await self._finish(v, "expired")
        validation = await self._validate(record)
        if validation.failed:
            await self._save(v, status="failed", errors=BatchErrors(data=list(validation.errors)))
            return "done"
        # `enqueued` is a line index of the file: every line below it was queued (or answered)
        # by whoever drove the batch then, whose keys and routes may have judged a line
        # otherwise than this gateway's: such a line is never answered with an error here
        for index, stored in validation.rejected:
            if index >= record.enqueued:
                await self.store.put_result(result_key(record.id, index), stored)
        done = {index for index, _ in await self.store.results(record.id)}
        # every valid line without a result is queued again, below the index too: the work
        # stream drops a duplicate id, a worker does not run a line that has a result, and
        # only the run whose result is stored is booked
        todo = [item for item in validation.items if item.index not in done]
        for start in range(0, len(todo), ENQUEUE_CHUNK):
            chunk = todo[start : start + ENQUEUE_CHUNK]
            await self.store.enqueue(chunk)
            reached = max(record.enqueued, (chunk[-1].index or 0) + 1)
            v = await self._save(v, enqueued=reached)  # Conflict: a cancel came; re-read, resume
        end = validation.lines[-1][0] + 1 if validation.lines else 0
        if v.value.enqueued < end:
            v = await self._save(v, enqueued=end)
        counts, usage = tally(await self.store.results(record.id), validation.total)
        await self._save(
            v,
            status="in_progress",
            expires_at=int(self._deadline(record)),
            request_counts=counts,
            usage=usage,
        )
        return "again"

    async def _in_progress(self, v: Versioned[BatchRecord]) -> Step:
        """Polls the count of results (cheap); reads them to show `request_counts` at most
        every `tally_s`, and once every line has one."""
        record = v.value
        stored = await self.store.result_count(record.id)
        if stored >= record.request_counts.total:
            counts, usage = tally(await self.store.results(record.id), record.request_counts.total)
            v = await self._save(v, status="finalizing", request_counts=counts, usage=usage)
            return await self._finish(v, "completed")
        if self.clock() >= self._deadline(record):
            return await self._finish(v, "expired")
        shown = record.request_counts.completed + record.request_counts.failed
        if stored != shown and self.clock() - self._tallied.get(record.id, float("-inf")) >= self.tally_s:
            self._tallied[record.id] = self.clock()
            counts, usage = tally(await self.store.results(record.id), record.request_counts.total)
            await self._save(v, request_counts=counts, usage=usage)
        return "wait"

    async def _cancelling(self, v: Versioned[BatchRecord]) -> Step:
        """Done once no item of the batch is queued or in flight; past the window, at once.
        Workers drop the queued items, but a deployment with no replica has no worker, and
        its items would count as demand and scale it from zero only to be dropped. So once
        this driver has seen the cancel for longer than a worker caches a batch's status
        (any worker that pulls an item now drops it unrun) and no worker holds an item that
        could be the batch's (no line of it runs), the driver purges them itself."""
        record = v.value
        first = self._cancel_seen.setdefault(record.id, self.clock())
        if not await self.store.pending_for(record.id) or self.clock() >= self._deadline(record):
            return await self._finish(v, "cancelled")
        if self.clock() - first >= CANCEL_SEEN_S and not await self.store.held_with(record.id):
            purged = await self.store.purge(record.id)
            log.info("batch %s: %d queued items purged", record.id, purged)
            return "again"
        return "wait"

    async def _finish(
        self, v: Versioned[BatchRecord], status: Literal["completed", "expired", "cancelled"]
    ) -> Step:
        """Write the output and error files and end the batch with `status`."""
        record = v.value
        results = await self.store.results(record.id)
        unfinished: Unfinished | None = None if status == "completed" else status
        if unfinished is None:
            lines = [(index, stored.line.custom_id) for index, stored in results]
        else:
            lines = list((await self._validate(record)).lines)  # none when the file is gone
            if await self._mark_unfinished(record.id, lines, results, unfinished):
                results = await self.store.results(record.id)
        outcome = finalize(record.id, lines, results, unfinished, total=record.request_counts.total)
        written: list[str] = []
        try:
            output_id = await self._write(record, "output", outcome.output, written)
            error_id = await self._write(record, "error", outcome.errors, written)
            await self._save(
                v,
                status=status,
                output_file_id=output_id,
                error_file_id=error_id,
                request_counts=outcome.request_counts,
                usage=outcome.usage,
            )
        except BaseException:
            for file_id in written:  # the record did not take them: nobody will read them
                with contextlib.suppress(Exception):
                    await self.store.delete_file(file_id)
            raise
        if unfinished is not None:
            await self._purge_over(record.id)
        return "done"

    async def _mark_unfinished(
        self,
        batch_id: str,
        lines: list[tuple[int, str]],
        results: list[tuple[int, StoredResult]],
        unfinished: Unfinished,
    ) -> bool:
        """Store the `batch_expired` (`batch_cancelled`) result of every line without one,
        create-once, before the files are written: a line still running loses its
        `put_result` to it, so it is neither shown otherwise nor booked. Whether a
        placeholder lost to a result stored meanwhile (the results must be read again)."""
        have = {index for index, _ in results}
        missing = [(index, custom_id) for index, custom_id in lines if index not in have]
        lost = False
        for start in range(0, len(missing), ENQUEUE_CHUNK):
            chunk = missing[start : start + ENQUEUE_CHUNK]
            stored = await asyncio.gather(
                *(
                    self.store.put_result(
                        result_key(batch_id, index),
                        StoredResult(line=unfinished_line(batch_id, index, custom_id, unfinished)),
                    )
                    for index, custom_id in chunk
                )
            )
            lost = lost or not all(stored)
        return lost or bool(missing)

    async def _purge_over(self, batch_id: str) -> None:
        """An expired or cancelled batch's items left on the queue: nothing reads their
        results any more, and until a worker drops them they count as demand."""
        try:
            purged = await self.store.purge(batch_id)
        except Exception as err:  # workers drop them all the same, later
            log.warning("purging %s failed (%s: %s)", batch_id, type(err).__name__, err)
            return
        if purged:
            log.info("batch %s: %d queued items purged", batch_id, purged)

    async def _write(self, record: BatchRecord, part: str, data: bytes, written: list[str]) -> str | None:
        if not data:
            return None
        file = FileRecord(
            id=new_file_id(),
            bytes=len(data),
            created_at=int(self.clock()),
            filename=f"{record.id}_{part}.jsonl",
            purpose="batch_output",
            key_id=record.key_id,
        )
        stored = await self.store.put_file(file, data)
        written.append(stored.id)
        return stored.id
