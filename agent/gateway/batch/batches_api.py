"""OpenAI's Batches API on the gateway: create, list, get, cancel. The driver
(`driver.BatchDriver`) moves a batch after creation; the API only writes the record a
client asked for (`validating`, `cancelling`). A key sees only its own batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent.gateway.batch.http import cursor_page, guarded, json_of, query_int
from agent.gateway.errors import GatewayError
from agent.gateway.inputs import read_body
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.models import (
    BATCH_ENDPOINTS,
    CANCELLABLE,
    COMPLETION_WINDOWS,
    MAX_METADATA_PAIRS,
    BatchRecord,
)
from fleet_base.batch.names import new_batch_id
from fleet_base.batch.store import Conflict, NotFound, Versioned
from fleet_base.bounds import InputError, load_json

if TYPE_CHECKING:
    from agent.gateway.batch.service import BatchService

MAX_BODY = 64 * 1024
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
CAS_TRIES = 8


def not_found(batch_id: str) -> GatewayError:
    return GatewayError(404, f"No batch found with id '{batch_id}'", param="batch_id")


def _bad(message: str, param: str | None, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("'metadata' must be an object of string keys and string values", "metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise _bad(f"'metadata' may have at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY:
            raise _bad(f"A 'metadata' key may be at most {MAX_METADATA_KEY} characters", "metadata")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise _bad(
                f"A 'metadata' value must be a string of at most {MAX_METADATA_VALUE} characters", "metadata"
            )
    return value


class BatchesApi:
    def __init__(self, service: BatchService) -> None:
        self.service = service

    def routes(self) -> list[Route]:
        return [
            Route("/v1/batches", guarded(self.create), methods=["POST"]),
            Route("/v1/batches", guarded(self.list), methods=["GET"]),
            Route("/v1/batches/{batch_id}", guarded(self.get), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", guarded(self.cancel), methods=["POST"]),
        ]

    async def own(self, request: Request) -> tuple[ApiKeyRecord, Versioned[BatchRecord]]:
        key = self.service.hooks.authenticate(request)
        batch_id = request.path_params["batch_id"]
        try:
            v = await self.service.require_store().batch(batch_id)
        except NotFound:
            raise not_found(batch_id) from None
        if v.value.key_id != key.key_id:
            raise not_found(batch_id)
        return key, v

    async def create(self, request: Request) -> Response:
        key = self.service.hooks.authenticate(request)
        store = self.service.require_store()
        try:
            body = load_json(await read_body(request, MAX_BODY))
        except InputError as err:
            raise GatewayError(400, str(err), code="invalid_json") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "The request body must be a JSON object", code="invalid_json")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if body.get(name) is None:
                raise _bad(f"Missing required parameter: '{name}'", name, "missing_required_parameter")
        endpoint, window, file_id = body["endpoint"], body["completion_window"], body["input_file_id"]
        if not isinstance(endpoint, str) or endpoint not in BATCH_ENDPOINTS:
            raise _bad(
                f"Invalid value for 'endpoint': supported are {', '.join(BATCH_ENDPOINTS)}", "endpoint"
            )
        if not isinstance(window, str) or window not in COMPLETION_WINDOWS:
            raise _bad(
                f"Invalid value for 'completion_window': supported are {', '.join(COMPLETION_WINDOWS)}",
                "completion_window",
            )
        metadata = _metadata(body.get("metadata"))
        if not isinstance(file_id, str):
            raise _bad("'input_file_id' must be a string", "input_file_id")
        try:
            file = await store.file(file_id)
        except NotFound:
            file = None
        if file is None or file.key_id != key.key_id:
            raise GatewayError(404, f"No such File object: {file_id}", param="input_file_id")
        if file.purpose != "batch":
            raise _bad(
                f"The file '{file_id}' has purpose '{file.purpose}'; a batch's input must be 'batch'",
                "input_file_id",
            )
        created = int(self.service.clock())
        record = BatchRecord(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=file_id,
            completion_window=window,
            created_at=created,
            expires_at=int(created + self.service.window_s(window)),
            metadata=metadata,
            key_id=key.key_id,
            cluster=self.service.hooks.cluster,
        )
        v = await store.create_batch(record)
        self.service.metrics.transitions.labels("validating").inc()
        self.service.wake()
        return json_of(v.value.public())

    async def list(self, request: Request) -> Response:
        key = self.service.hooks.authenticate(request)
        limit = query_int(request, "limit", 20, 1, 100)
        records = await self.service.require_store().batches(key.key_id)
        records.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        return JSONResponse(
            cursor_page([b.public() for b in records], limit, request.query_params.get("after"))
        )

    async def get(self, request: Request) -> Response:
        _, v = await self.own(request)
        return json_of(v.value.public())

    async def cancel(self, request: Request) -> Response:
        _, v = await self.own(request)
        store = self.service.require_store()
        for _ in range(CAS_TRIES):
            record = v.value
            if record.status in ("cancelling", "cancelled"):
                return json_of(record.public())
            if record.status not in CANCELLABLE:
                raise GatewayError(
                    409, f"Cannot cancel a batch with status '{record.status}'", code="batch_not_cancellable"
                )
            changed = record.model_copy(
                update={"status": "cancelling", "cancelling_at": int(self.service.clock())}
            )
            try:
                v = await store.update_batch(changed, v.revision)
            except Conflict:  # the driver moved it: decide again on what it is now
                v = await store.batch(record.id)
                continue
            self.service.metrics.transitions.labels("cancelling").inc()
            self.service.wake()
            return json_of(v.value.public())
        raise GatewayError(503, "The batch is changing too fast to cancel; try again", code="conflict")
