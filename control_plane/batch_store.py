"""The control plane's read of the batch store, through its own NATS link.

Batches and async requests live in JetStream (`fleet_base.batch`), not in the database, so
every control-plane instance, leader or follower, reads them the same way; while NATS is
unreachable (or the batch resources do not exist yet) the answer is `BatchStoreDown` with
a reason a person can act on, which the API turns into a 503. The one write the control
plane makes is a cancel: a compare-and-set of the record to `cancelling`, after which the
driving gateway stops dispatching and finishes the batch (docs/batch.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import nats.errors

from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import CANCELLABLE, AsyncRecord, BatchRecord
from fleet_base.batch.store import BatchStore, Conflict, NotFound

if TYPE_CHECKING:
    from fleet_base.nats_io import NatsLink

log = logging.getLogger(__name__)

Opener = Callable[[Any, BatchConfig], Awaitable[BatchStore]]
CANCEL_ATTEMPTS = 3  # re-reads after a lost compare-and-set before answering 409
CALL_TIMEOUT_S = 10.0  # one API call's reads, so a NATS that hangs answers 503, not never


class BatchStoreDown(Exception):
    """The batch store cannot be read now (NATS unreachable, resources missing)."""


class NotCancellable(Exception):
    """The batch is in a status a cancel cannot move it from."""

    def __init__(self, batch_id: str, status: str) -> None:
        super().__init__(
            f"batch {batch_id} is {status}: only a validating or in_progress batch can be cancelled"
        )
        self.status = status


class CancelRaced(Exception):
    """Every compare-and-set of a cancel lost to a concurrent writer."""


async def _default_opener(nc: Any, config: BatchConfig) -> BatchStore:
    from fleet_base.batch.nats_store import open_batch_store

    return await open_batch_store(nc, config)


class BatchStoreLink:
    """One store per NATS connection object: opened (bound, never created) on first use
    after a connect, and re-opened when the link has a new connection."""

    def __init__(
        self, nats: NatsLink | None, opener: Opener | None = None, config: BatchConfig | None = None
    ) -> None:
        self.nats = nats
        self.opener = opener or _default_opener
        self.config = config or BatchConfig()
        self._nc: object | None = None
        self._store: BatchStore | None = None
        self._lock = asyncio.Lock()

    async def store(self) -> BatchStore:
        link = self.nats
        if link is None:
            raise BatchStoreDown("this control plane has no NATS connection, where batches are kept")
        if not link.is_connected or link.nc is None:
            raise BatchStoreDown("NATS is unreachable: batches and async requests cannot be read now")
        async with self._lock:
            if self._store is None or self._nc is not link.nc:
                try:
                    store = await asyncio.wait_for(self.opener(link.nc, self.config), CALL_TIMEOUT_S)
                except (NotFound, nats.errors.Error, asyncio.TimeoutError, OSError) as err:
                    raise BatchStoreDown(
                        f"the batch store is not available in JetStream ({type(err).__name__}: {err}); "
                        "the control plane creates it on connect"
                    ) from err
                self._nc, self._store = link.nc, store
            return self._store

    @contextlib.asynccontextmanager
    async def using(self) -> AsyncIterator[BatchStore]:
        """The store, with NATS failures and timeouts during its use raised as
        `BatchStoreDown` (a record that is absent or moved stays `NotFound`/`Conflict`)."""
        store = await self.store()
        try:
            yield store
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as err:
            log.info("batch store read failed: %s: %s", type(err).__name__, err)
            raise BatchStoreDown(f"NATS failed while reading batches ({type(err).__name__}: {err})") from err


T = TypeVar("T", BatchRecord, AsyncRecord)


def newest_first(records: Iterable[T], status: str | None = None, key_id: str | None = None) -> list[T]:
    """`records` narrowed to `status` and `key_id` (None: any), newest first (ties by id,
    so pages are stable)."""
    kept = [
        r
        for r in records
        if (status is None or r.status == status) and (key_id is None or r.key_id == key_id)
    ]
    return sorted(kept, key=lambda r: (-r.created_at, r.id))


async def cancel_batch(store: BatchStore, batch_id: str, now: float | None = None) -> BatchRecord:
    """Move the batch to `cancelling` by compare-and-set on the revision read; a lost CAS
    re-reads (the batch may have finished meanwhile: `NotCancellable`) and tries again, up
    to `CANCEL_ATTEMPTS` times (`CancelRaced`). `NotFound` when there is no such batch."""
    for _ in range(CANCEL_ATTEMPTS):
        current = await store.batch(batch_id)
        record = current.value
        if record.status not in CANCELLABLE:
            raise NotCancellable(batch_id, record.status)
        at = int(time.time() if now is None else now)
        moved = record.model_copy(update={"status": "cancelling", "cancelling_at": at})
        try:
            return (await store.update_batch(moved, current.revision)).value
        except Conflict:
            continue
    raise CancelRaced(
        f"batch {batch_id} changed {CANCEL_ATTEMPTS} times while it was being cancelled; try again"
    )
