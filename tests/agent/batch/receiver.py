"""A real HTTP webhook receiver on 127.0.0.1 (uvicorn in the test's loop) that can be down
(nothing listening: connection refused) and come up later on the same port."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet_base.ports import free_port


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int = field(default_factory=lambda: free_port("127.0.0.1"))
    statuses: list[int] = field(default_factory=list)  # answers to give, in turn; then 200
    tls: tuple[str, str] | None = None  # (certificate, key): serve https
    delays: list[float] = field(default_factory=list)  # seconds to stall before answering, in turn
    received: list[Received] = field(default_factory=list)
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/hook"

    async def _hook(self, request: Request) -> Response:
        self.received.append(Received(request.url.path, dict(request.headers), await request.body()))
        if self.delays:
            await asyncio.sleep(self.delays.pop(0))
        status = self.statuses.pop(0) if self.statuses else 200
        headers = {"location": "http://127.0.0.1:1/elsewhere"} if 300 <= status < 400 else {}
        return Response(b"ok", status_code=status, headers=headers)

    async def start(self) -> None:
        app = Starlette(routes=[Route("/hook", self._hook, methods=["POST"])])
        cert, key = self.tls or (None, None)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            ssl_certfile=cert,
            ssl_keyfile=key,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
