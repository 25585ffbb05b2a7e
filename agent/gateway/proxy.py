"""One attempt at a replica or peer gateway, up to its first body byte.

Everything that can fail before the client has seen a byte (connect, reset, a 5xx, a
body that breaks before its first chunk) raises `AttemptFailed`, which the gateway may
retry elsewhere. Once `open_upstream` returns, the response is the client's.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from fleet_base import tracing
from fleet_base.listener import POOL_KEEPALIVE_S
from fleet_base.openai_contract.timing import TTFT_HEADER, read_ttft
from fleet_base.tracing import INVALID_SPAN, Span

# Response headers of a replica or peer worth passing to the client.
# x-fleet-pipeline-request: the id a peer that runs a pipeline request gave it
PASS_HEADERS = (
    "content-type",
    "retry-after",
    "x-fleet-cluster",
    "x-fleet-version",
    "x-fleet-pipeline-request",
)
PASS_PREFIXES = ("x-ratelimit-",)
MAX_ERROR_BODY = 64 * 1024
# A replica's 5xx that is the request's own failure (the engine's header): passed to the
# client, not retried on another replica, like a 4xx.
NO_RETRY_HEADER = "x-fleet-no-retry"


def make_client(read_timeout_s: float = 600.0, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """The gateway's one upstream client: pooled keep-alive connections, a short connect
    timeout (a dead replica is found fast and retried elsewhere), a read timeout long
    enough for a non-streamed generation, and no proxies from the environment. Replicas and
    peers keep an idle connection longer than this pool does (`fleet_base.listener`). `verify`:
    the fleet CA context (with the gateway's client certificate) on a secured cluster."""
    return httpx.AsyncClient(
        verify=verify,
        timeout=httpx.Timeout(connect=2.0, read=read_timeout_s, write=30.0, pool=10.0),
        limits=httpx.Limits(
            max_connections=2048, max_keepalive_connections=256, keepalive_expiry=POOL_KEEPALIVE_S
        ),
        trust_env=False,
        follow_redirects=False,
    )


class AttemptFailed(Exception):
    def __init__(
        self,
        reason: str,
        detail: str,
        status: int | None = None,
        body: bytes = b"",
        headers: dict | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # connect | status_5xx | read | timeout
        self.detail = detail
        self.status = status
        self.body = body
        self.headers = headers or {}


@dataclass
class Opened:
    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes] = field(repr=False)
    span: Span = field(default=INVALID_SPAN, repr=False)  # the attempt's, ended with it
    sent_at: float = 0.0  # time.monotonic() when the request went out

    @property
    def status(self) -> int:
        return self.response.status_code

    def first_token_s(self, since: float) -> float | None:
        """A non-streamed answer's time to first token from `since` (the request's arrival
        here): the time until it was sent plus the upstream's own figure (its
        `TTFT_HEADER`), taken only when that fits inside this attempt's time."""
        now = time.monotonic()
        upstream = read_ttft(self.response.headers.get(TTFT_HEADER), now - self.sent_at)
        if upstream is None:
            return None
        return max(0.0, self.sent_at - since) + upstream

    def headers(self) -> dict[str, str]:
        return pass_headers(self.response.headers)

    async def read_rest(self) -> bytes:
        """The remaining body; a break here is still before the client's first byte."""
        parts = [self.first]
        try:
            async for chunk in self.rest:
                parts.append(chunk)
        except httpx.HTTPError as err:
            await self.response.aclose()
            raise AttemptFailed("read", f"{type(err).__name__}: {err}") from None
        return b"".join(parts)

    async def close(self) -> None:
        await self.response.aclose()
        self.end_span()

    def end_span(self, failure: str | None = None) -> None:
        """The attempt is over (answered, failed with `failure`, or abandoned)."""
        if self.span.is_recording():
            if failure is not None:
                tracing.fail(self.span, failure)
            self.span.end()


def pass_headers(headers: httpx.Headers) -> dict[str, str]:
    return {
        k: v for k, v in headers.items() if k.lower() in PASS_HEADERS or k.lower().startswith(PASS_PREFIXES)
    }


@dataclass(frozen=True)
class Deadlines:
    """Per-attempt time limits: until the first body byte (for a non-streamed answer that
    is the whole generation), and between chunks after it. A hung replica costs a client
    at most these, not one long read timeout; None: no limit."""

    first_byte_s: float | None = None
    gap_s: float | None = None


async def _gapped(chunks: AsyncIterator[bytes], gap_s: float | None) -> AsyncIterator[bytes]:
    """`chunks`, raising httpx.ReadTimeout when the next one takes longer than `gap_s`."""
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), gap_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"no data from the upstream for {gap_s:g} s") from None
        yield chunk


async def open_upstream(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: bytes,
    deadlines: Deadlines = Deadlines(),
) -> Opened:
    sent_at = time.monotonic()
    try:
        opened = await asyncio.wait_for(_open(client, url, headers, body, deadlines), deadlines.first_byte_s)
    except asyncio.TimeoutError:
        raise AttemptFailed(
            "timeout",
            f"no first byte within {deadlines.first_byte_s:g} s (the upstream is hung or overloaded)",
        ) from None
    opened.sent_at = sent_at
    return opened


async def _open(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: bytes, deadlines: Deadlines
) -> Opened:
    try:
        request = client.build_request(
            "POST", url, headers={**headers, "accept-encoding": "identity"}, content=body
        )
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise AttemptFailed("connect", f"bad upstream URL {url!r}: {err}") from None
    try:
        response = await client.send(request, stream=True)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise AttemptFailed("connect", f"{type(err).__name__}: {err}") from None
    try:
        return await _first_byte(response, deadlines)
    except BaseException:  # a timeout cancels us here: the connection must not leak
        await response.aclose()
        raise


async def _first_byte(response: httpx.Response, deadlines: Deadlines) -> Opened:
    if response.status_code >= 500 and not response.headers.get(NO_RETRY_HEADER):
        try:
            data = await _read_bounded(response)
        except httpx.HTTPError:
            data = b""
        finally:
            await response.aclose()
        raise AttemptFailed(
            "status_5xx",
            f"HTTP {response.status_code}",
            status=response.status_code,
            body=data,
            headers=pass_headers(response.headers),
        )
    rest = _gapped(response.aiter_raw(), deadlines.gap_s)
    try:
        first = await rest.__anext__()
    except StopAsyncIteration:
        first = b""
    except httpx.HTTPError as err:
        await response.aclose()
        raise AttemptFailed("read", f"{type(err).__name__}: {err}") from None
    return Opened(response, first, rest)


async def _read_bounded(response: httpx.Response) -> bytes:
    data = b""
    async for chunk in response.aiter_raw():
        data += chunk
        if len(data) > MAX_ERROR_BODY:
            break
    return data[:MAX_ERROR_BODY]
