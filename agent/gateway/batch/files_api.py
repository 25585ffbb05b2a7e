"""OpenAI's Files API on the gateway: upload (purpose `batch`, multipart), list, get,
content, delete. A key sees only its own files; another key's id answers 404."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent.gateway.batch.http import cursor_page, guarded, json_of, query_int
from agent.gateway.errors import GatewayError
from agent.gateway.inputs import read_body
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.models import FileRecord
from fleet_base.batch.names import new_file_id
from fleet_base.batch.store import NotFound

if TYPE_CHECKING:
    from agent.gateway.batch.service import BatchService

UPLOAD_PURPOSES = ("batch",)
MULTIPART_SLACK = 64 * 1024  # the form's own bytes around the file
MAX_LIST = 10_000


def not_found(file_id: str) -> GatewayError:
    return GatewayError(404, f"No such File object: {file_id}", param="id")


class FilesApi:
    def __init__(self, service: BatchService) -> None:
        self.service = service

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", guarded(self.create), methods=["POST"]),
            Route("/v1/files", guarded(self.list), methods=["GET"]),
            Route("/v1/files/{file_id}", guarded(self.get), methods=["GET"]),
            Route("/v1/files/{file_id}", guarded(self.delete), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", guarded(self.content), methods=["GET"]),
        ]

    async def own(self, request: Request) -> tuple[ApiKeyRecord, FileRecord]:
        """The key, and the file named in the path when it is the key's own."""
        key = self.service.hooks.authenticate(request)
        file_id = request.path_params["file_id"]
        try:
            record = await self.service.require_store().file(file_id)
        except NotFound:
            raise not_found(file_id) from None
        if record.key_id != key.key_id:
            raise not_found(file_id)
        return key, record

    async def create(self, request: Request) -> Response:
        key = self.service.hooks.authenticate(request)
        store = self.service.require_store()
        limit = self.service.config.max_file_bytes
        too_large = GatewayError(
            413,
            f"File is larger than this gateway's limit of {limit} bytes",
            param="file",
            code="file_too_large",
        )
        try:
            raw = await read_body(request, limit + MULTIPART_SLACK)
        except GatewayError as err:
            raise too_large if err.status == 413 else err from None
        filename, data, purpose = await _parse_upload(request, raw)
        if purpose is None:
            raise GatewayError(
                400,
                "Missing required parameter: 'purpose'",
                param="purpose",
                code="missing_required_parameter",
            )
        if purpose not in UPLOAD_PURPOSES:
            raise GatewayError(
                400,
                f"Invalid value for 'purpose': '{purpose}'; this gateway accepts: {', '.join(UPLOAD_PURPOSES)}",
                param="purpose",
                code="invalid_value",
            )
        if data is None:
            raise GatewayError(
                400, "Missing required parameter: 'file'", param="file", code="missing_required_parameter"
            )
        if len(data) > limit:
            raise too_large
        record = FileRecord(
            id=new_file_id(),
            bytes=len(data),
            created_at=int(self.service.clock()),
            filename=filename,
            purpose=purpose,
            key_id=key.key_id,
            sha256=hashlib.sha256(data).hexdigest(),
        )
        stored = await store.put_file(record, data)
        return json_of(stored.public())

    async def list(self, request: Request) -> Response:
        key = self.service.hooks.authenticate(request)
        files = await self.service.require_store().files(key.key_id)
        purpose = request.query_params.get("purpose")
        if purpose:
            files = [f for f in files if f.purpose == purpose]
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise GatewayError(400, "'order' must be 'asc' or 'desc'", param="order", code="invalid_value")
        files.sort(key=lambda f: (f.created_at, f.id), reverse=order == "desc")
        limit = query_int(request, "limit", MAX_LIST, 1, MAX_LIST)
        return JSONResponse(
            cursor_page([f.public() for f in files], limit, request.query_params.get("after"))
        )

    async def get(self, request: Request) -> Response:
        _, record = await self.own(request)
        return json_of(record.public())

    async def content(self, request: Request) -> Response:
        _, record = await self.own(request)
        try:
            data = await self.service.require_store().file_content(record)
        except NotFound:
            raise not_found(record.id) from None
        return Response(data, media_type="application/octet-stream")

    async def delete(self, request: Request) -> Response:
        """A batch not over still reads its input file (a takeover validates it again, an
        expiry or cancel names its unfinished lines from it): deleting it then is a 409."""
        key, record = await self.own(request)
        store = self.service.require_store()
        using = [
            b.id for b in await store.batches(key.key_id) if b.input_file_id == record.id and not b.terminal
        ]
        if using:
            raise GatewayError(
                409,
                f"The file '{record.id}' is the input of batch '{using[0]}', which is not over yet; "
                "cancel it or wait for it to end",
                code="file_in_use",
            )
        try:
            await store.delete_file(record.id)
        except NotFound:
            raise not_found(record.id) from None
        return JSONResponse({"id": record.id, "object": "file", "deleted": True})


async def _parse_upload(request: Request, raw: bytes) -> tuple[str, bytes | None, str | None]:
    """(filename, the file's bytes, purpose) of a multipart upload already read whole."""
    sent = False

    async def replay() -> dict[str, object]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise GatewayError(
            400, "An upload must be multipart/form-data with 'file' and 'purpose'", code="invalid_request"
        )
    try:
        async with Request(request.scope, replay).form(max_files=1, max_fields=8) as form:
            upload = form.get("file")
            purpose = form.get("purpose")
            if isinstance(upload, UploadFile):
                return (
                    upload.filename or "upload.jsonl",
                    await upload.read(),
                    purpose if isinstance(purpose, str) else None,
                )
            return "", None, purpose if isinstance(purpose, str) else None
    except HTTPException as err:
        raise GatewayError(
            400, f"The upload is not a valid multipart form: {err.detail}", code="invalid_request"
        ) from None
