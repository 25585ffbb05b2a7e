"""The shared listener hardening (fleet_base.listener) in one process, over real sockets:
limits from the environment, deadlines that data cannot extend, keep-alive and pipelining
still working, and the refusal counters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet_base.listener import (
    BEHIND_POOL_KEEPALIVE_S,
    POOL_KEEPALIVE_S,
    REFUSED,
    ListenerLimits,
    RefusalCollector,
    uvicorn_options,
)
from fleet_base.ports import free_port
from tests.polling import eventually

LIMITS = ListenerLimits(max_connections=3, header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=5)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ListenerLimits()),
        ({"FLEET_MAX_CONNECTIONS": "10", "FLEET_HEADER_TIMEOUT_S": "2.5"}, {"max_connections": 10, "header_timeout_s": 2.5}),
        ({"FLEET_BODY_TIMEOUT_S": " "}, ListenerLimits()),
        ({"FLEET_KEEPALIVE_TIMEOUT_S": "1", "FLEET_MAX_HEADER_BYTES": "4096"}, {"keepalive_timeout_s": 1, "max_header_bytes": 4096}),
        ({"FLEET_MAX_CONNECTIONS": "0"}, "FLEET_MAX_CONNECTIONS='0'"),
        ({"FLEET_HEADER_TIMEOUT_S": "nan"}, "FLEET_HEADER_TIMEOUT_S"),
        ({"FLEET_BODY_TIMEOUT_S": "soon"}, "FLEET_BODY_TIMEOUT_S"),
        ({"FLEET_MAX_HEADER_BYTES": "10"}, "FLEET_MAX_HEADER_BYTES"),
    ],
)  # fmt: skip
def test_limits_from_env(env: dict[str, str], expected: object) -> None:
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            ListenerLimits.from_env(env)
    elif isinstance(expected, dict):
        assert ListenerLimits.from_env(env) == ListenerLimits(**expected)
    else:
        assert ListenerLimits.from_env(env) == expected


@pytest.mark.parametrize(
    ("env", "keepalive"),
    [
        ({}, BEHIND_POOL_KEEPALIVE_S),
        ({"FLEET_KEEPALIVE_TIMEOUT_S": "1"}, BEHIND_POOL_KEEPALIVE_S),
        ({"FLEET_KEEPALIVE_TIMEOUT_S": "300"}, 300),
    ],
)
def test_a_listener_behind_the_pool_keeps_idle_connections_longer_than_the_pool(
    env: dict[str, str], keepalive: float
) -> None:
    limits = ListenerLimits.from_env({**env, "FLEET_MAX_CONNECTIONS": "7"}, behind_pool=True)
    assert limits.keepalive_timeout_s == keepalive > POOL_KEEPALIVE_S
    assert limits.max_connections == 7  # the other limits are the environment's
    assert uvicorn_options(behind_pool=True)["timeout_keep_alive"] > POOL_KEEPALIVE_S


def test_uvicorn_options_apply_the_limits() -> None:
    opts = uvicorn_options(LIMITS)
    assert opts["http"].limits == LIMITS
    assert opts["limit_concurrency"] == 4 and opts["timeout_keep_alive"] == 5
    assert opts["h11_max_incomplete_event_size"] == LIMITS.max_header_bytes


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"got": len(await request.body())})


@pytest.fixture
async def server() -> AsyncIterator[int]:
    port = free_port()
    app = Starlette(routes=[Route("/echo", _echo, methods=["POST", "GET"])])
    srv = uvicorn.Server(
        uvicorn.Config(app, port=port, log_level="error", lifespan="off", **uvicorn_options(LIMITS))
    )
    task = asyncio.create_task(srv.serve())
    await eventually(lambda: srv.started, 10)
    yield port
    srv.should_exit = True
    await task


async def _closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything the server sent until it closed the connection."""
    return await asyncio.wait_for(reader.read(), timeout)


async def _dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    """Send `data` a byte every 50 ms until the server closes; what it sent."""
    closed = asyncio.create_task(_closed(reader))
    for byte in data:
        if closed.done():
            break
        try:
            writer.write(bytes([byte]))
        except OSError:
            break
        await asyncio.sleep(0.05)
    return await closed


def _request(body: bytes = b"") -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_keep_alive_and_pipelining_still_work_and_the_next_head_has_a_deadline(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(_request(b"abc") + _request(b"hello"))  # two pipelined requests
    await writer.drain()
    replies = b""
    while replies.count(b'{"got":') < 2:
        replies += await asyncio.wait_for(reader.read(4096), 5)
    assert b'{"got":3}' in replies and b'{"got":5}' in replies
    before = REFUSED["header_timeout"]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tail = await _dribble(
        reader, writer, b"POST /echo HTTP/1.1\r\nHost: t\r\nX-Slow: 1234567"
    )  # the third, slowly
    assert tail.startswith(b"HTTP/1.1 408") and b"request_timeout" in tail
    assert loop.time() - t0 < LIMITS.header_timeout_s + 1.0
    assert REFUSED["header_timeout"] == before + 1
    writer.close()


async def test_slow_body_gets_408_and_a_prompt_one_is_served(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n")
    reply = await _dribble(reader, writer, b"x" * 30)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nConnection: close\r\n\r\n")
    await asyncio.sleep(0.2)  # slow, but within the deadline
    writer.write(b"abcd")
    assert b'{"got":4}' in await _closed(reader)
    writer.close()


async def test_connections_past_the_cap_are_refused_at_once(server: int) -> None:
    before = REFUSED["connection_cap"]
    held = [await asyncio.open_connection("127.0.0.1", server) for _ in range(LIMITS.max_connections)]
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    reply = await _closed(reader, 2.0)
    assert reply.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in reply
    assert REFUSED["connection_cap"] == before + 1
    writer.close()
    registry = CollectorRegistry()
    registry.register(RefusalCollector())
    assert b'fleet_listener_refused_total{reason="connection_cap"}' in generate_latest(registry)
    for _, w in held:
        w.close()


async def test_a_head_past_the_header_size_is_refused(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (LIMITS.max_header_bytes + 1024))
    reply = await _closed(reader, 2.0)
    assert reply.startswith(b"HTTP/1.1 400")
    writer.close()
