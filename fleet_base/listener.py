"""One hardening for every HTTP listener (gateway, its peer listener, control plane, engine
and simulated replicas): a slow or greedy client costs a bounded share of the process.

uvicorn bounds idle keep-alive connections and header size, but not how long a client may
take to send a request: a client that dribbles its head or body a byte at a time holds a
connection (and, for a body, the handler's task) forever, and enough of them exhaust the
file descriptors (slowloris). `GuardedH11Protocol` adds one deadline per connection:

- the request head must be complete within `header_timeout_s` of the connection opening
  (or, on a kept-alive connection, of the next request's first byte), else 408 and close;
- the body must be complete within `body_timeout_s` of the head, else 408 (when no answer
  was started) and close. Data arriving does not extend either deadline.
- past `max_connections` open connections a new one is answered 503 with Retry-After and
  closed at once, before any of its bytes are read.

A listener whose clients are the fleet's own connection pools (a replica, a gateway's peer
listener) keeps an idle connection longer than those pools do (`behind_pool`): whichever end
closes an idle connection first should be the client. A server that closes first races the
pool (a request written as the close arrives fails), and its TLS shutdown waits for a
close_notify the idle pool never reads, holding the connection's buffers until it times out.

Limits come from the environment (`ListenerLimits.from_env`, names in `ENV`); refusals are
counted per process and exposed as `fleet_listener_refused_total{reason}` by the servers
that have a /metrics (`RefusalCollector`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import h11
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from fleet_base.openai_contract.errors import error_body

ENV = {
    "max_connections": "FLEET_MAX_CONNECTIONS",
    "header_timeout_s": "FLEET_HEADER_TIMEOUT_S",
    "body_timeout_s": "FLEET_BODY_TIMEOUT_S",
    "keepalive_timeout_s": "FLEET_KEEPALIVE_TIMEOUT_S",
    "max_header_bytes": "FLEET_MAX_HEADER_BYTES",
}
REASONS = ("connection_cap", "header_timeout", "body_timeout")
# How long the fleet's own HTTP clients (the gateway's pool to replicas and peers) keep an
# idle connection, and the least a listener behind such a pool keeps one.
POOL_KEEPALIVE_S = 30.0
BEHIND_POOL_KEEPALIVE_S = 2 * POOL_KEEPALIVE_S


class ListenerLimits(BaseModel):
    """What one listener grants one client; defaults suit a gateway in front of many streams."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_connections: int = Field(2048, ge=1)
    header_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    body_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    keepalive_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    max_header_bytes: int = Field(16 * 1024, ge=1024)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, behind_pool: bool = False) -> ListenerLimits:
        """The limits set in the environment (ENV names), the defaults for the others;
        ValueError naming the variable for a bad value. `behind_pool`: the keep-alive is at
        least BEHIND_POOL_KEEPALIVE_S whatever the environment says (it bounds the idle
        connections of clients; here the only clients are pools that must close first)."""
        env = os.environ if env is None else env
        given = {field: env[name] for field, name in ENV.items() if env.get(name, "").strip()}
        try:
            limits = cls.model_validate(given)
        except ValidationError as err:
            first = err.errors()[0]
            name = ENV.get(str(first["loc"][0]), str(first["loc"][0]))
            raise ValueError(f"{name}={given.get(str(first['loc'][0]))!r}: {first['msg']}") from None
        if behind_pool and limits.keepalive_timeout_s < BEHIND_POOL_KEEPALIVE_S:
            limits = limits.model_copy(update={"keepalive_timeout_s": BEHIND_POOL_KEEPALIVE_S})
        return limits


# refusals of every listener of this process, by reason
REFUSED: collections.Counter[str] = collections.Counter({r: 0 for r in REASONS})


class RefusalCollector(Collector):
    """`<prefix>listener_refused_total{reason}` for a server's own registry: `fleet_` by
    default, the server's own prefix where its registry keeps one (the control plane's)."""

    def __init__(self, prefix: str = "fleet_") -> None:
        self.prefix = prefix

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            f"{self.prefix}listener_refused",
            "Connections this process's HTTP listeners closed: past the connection cap, or too slow "
            "to send a request head or body.",
            labels=["reason"],
        )
        for reason, n in sorted(REFUSED.items()):
            family.add_metric([reason], n)
        yield family


def _raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message, code=reason)).encode()
    head = (
        f"HTTP/1.1 {status} {'Service Unavailable' if status == 503 else 'Request Timeout'}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


_OVER_CAP = _raw_response(
    503,
    "too_many_connections",
    "This server has too many open connections; retry shortly",
    "retry-after: 1\r\n",
)
_SLOW_HEAD = _raw_response(408, "request_timeout", "The request head was not received in time")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a deadline to receive each request."""

    limits: ClassVar[ListenerLimits] = ListenerLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""  # "head" or "body": what the running deadline waits for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            REFUSED["connection_cap"] += 1
            transport.write(_OVER_CAP)
            transport.close()
            return
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm("head")  # a kept-alive connection's next request begins
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()  # a pipelined request may have been read meanwhile

    def _follow(self) -> None:
        """Move the deadline along with what the client has sent."""
        state = self.conn.their_state
        if self._phase == "head" and state is not h11.IDLE:
            self._disarm()
            if state is h11.SEND_BODY:
                self._arm("body")
        elif self._phase == "body" and state is not h11.SEND_BODY:
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        seconds = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expired(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        if phase == "head":
            REFUSED["header_timeout"] += 1
            self.transport.write(_SLOW_HEAD)
        else:
            REFUSED["body_timeout"] += 1
            self._answer_slow_body()
        self.transport.close()

    def _answer_slow_body(self) -> None:
        """408 when the handler has not answered yet; the handler then reads a disconnect
        and whatever it sends is dropped."""
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            return
        cycle.disconnected = True
        cycle.message_event.set()
        body = json.dumps(
            error_body(408, "The request body was not received in time", code="request_timeout")
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=408, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass


def protocol_for(limits: ListenerLimits) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_options(limits: ListenerLimits | None = None, *, behind_pool: bool = False) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` that apply `limits` (default: from the
    environment, `behind_pool` as `ListenerLimits.from_env`). uvicorn's own
    `limit_concurrency` backs the connection cap for requests (503 past it); the protocol
    refuses the connection itself before it can hold a slot."""
    limits = limits or ListenerLimits.from_env(behind_pool=behind_pool)
    return {
        "http": protocol_for(limits),
        "limit_concurrency": limits.max_connections + 1,  # uvicorn refuses at >=; the cap admits max
        "timeout_keep_alive": limits.keepalive_timeout_s,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
    }
