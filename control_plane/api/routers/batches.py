"""Batches and async requests of every key, read from the batch store in JetStream
(`control_plane.batch_store`): list, get, cancel. The gateways serve each key its own
(docs/batch.md); this is the operator's view. While NATS is unreachable every route
answers 503 with the reason."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from sqlalchemy import select

from control_plane.api.audit import audit
from control_plane.api.deps import PagingDep, PrincipalDep
from control_plane.api.errors import ApiError, conflict, not_found
from control_plane.api.schemas import AsyncRequestOut, BatchOut, Page
from control_plane.batch_store import (
    CALL_TIMEOUT_S,
    BatchStoreDown,
    BatchStoreLink,
    CancelRaced,
    NotCancellable,
    cancel_batch,
    newest_first,
)
from control_plane.db.models import ApiKey
from fleet_base.batch.models import AsyncStatus, BatchStatus
from fleet_base.batch.store import NotFound

router = APIRouter(tags=["batches"])

BatchId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]+$", max_length=128)]
KeyIdFilter = Annotated[str | None, Query(max_length=32, description="only this key's")]


def link_of(request: Request) -> BatchStoreLink:
    """The app's link to the batch store (`build_app` makes it)."""
    return request.app.state.batch_link


def unavailable(err: BatchStoreDown) -> ApiError:
    return ApiError(503, str(err), type="unavailable")


def _key_names(request: Request, key_ids: set[str]) -> dict[str, str]:
    if not key_ids:
        return {}
    with request.app.state.ctx.sessions() as session:
        rows = session.execute(select(ApiKey.key_id, ApiKey.name).where(ApiKey.key_id.in_(key_ids)))
        return {key_id: name for key_id, name in rows}


async def _named(request: Request, records: list[Any], out: type) -> list[Any]:
    names = await asyncio.to_thread(_key_names, request, {r.key_id for r in records})
    return [out.model_validate(r.model_dump() | {"key_name": names.get(r.key_id)}) for r in records]


async def _read(request: Request, read):
    """`read(store)` within the call timeout; NATS failing or absent is a 503."""
    try:
        async with link_of(request).using() as store:
            return await asyncio.wait_for(read(store), CALL_TIMEOUT_S)
    except BatchStoreDown as err:
        raise unavailable(err) from None
    except asyncio.TimeoutError:
        raise unavailable(BatchStoreDown(f"NATS did not answer within {CALL_TIMEOUT_S:g}s")) from None


@router.get("/v1/batches", response_model=Page[BatchOut])
async def list_batches(
    request: Request,
    who: PrincipalDep,
    page: PagingDep,
    status: Annotated[BatchStatus | None, Query(description="only batches in this status")] = None,
    key_id: KeyIdFilter = None,
):
    """Every key's batches, newest first."""
    records = newest_first(await _read(request, lambda s: s.batches(key_id)), status, key_id)
    shown = records[page.offset : page.offset + page.limit]
    return Page(
        items=await _named(request, shown, BatchOut), total=len(records), limit=page.limit, offset=page.offset
    )


@router.get("/v1/batches/{batch_id}", response_model=BatchOut)
async def get_batch(batch_id: BatchId, request: Request, who: PrincipalDep):
    try:
        found = await _read(request, lambda s: s.batch(batch_id))
    except NotFound:
        raise not_found("batch", batch_id) from None
    return (await _named(request, [found.value], BatchOut))[0]


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchOut)
async def cancel(batch_id: BatchId, request: Request, who: PrincipalDep):
    """`cancelling` by compare-and-set, from validating or in_progress only (409 otherwise):
    the gateway driving the batch stops dispatching, lets in-flight lines finish, and marks
    it `cancelled` with the finished part."""
    try:
        moved = await _read(request, lambda s: cancel_batch(s, batch_id))
    except NotFound:
        raise not_found("batch", batch_id) from None
    except (NotCancellable, CancelRaced) as err:
        raise conflict(str(err), "status") from None

    def record() -> None:
        with request.app.state.ctx.sessions() as session:
            audit(
                session,
                who,
                "batch.cancel",
                "batch",
                batch_id,
                None,
                {"status": moved.status, "key_id": moved.key_id},
            )
            session.commit()

    await asyncio.to_thread(record)
    return (await _named(request, [moved], BatchOut))[0]


@router.get("/v1/async/requests", response_model=Page[AsyncRequestOut])
async def list_async_requests(
    request: Request,
    who: PrincipalDep,
    page: PagingDep,
    status: Annotated[AsyncStatus | None, Query(description="only requests in this status")] = None,
    key_id: KeyIdFilter = None,
):
    """Every key's async requests, newest first (without their results)."""
    records = newest_first(await _read(request, lambda s: s.async_requests(key_id)), status, key_id)
    shown = [r.model_copy(update={"result": None}) for r in records[page.offset : page.offset + page.limit]]
    return Page(
        items=await _named(request, shown, AsyncRequestOut),
        total=len(records),
        limit=page.limit,
        offset=page.offset,
    )
