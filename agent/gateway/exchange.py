"""One client request as the request path carries it: what is fixed once it is admitted
(`Call`, read by every later step), the little that changes while it is served
(`Progress`), and the quota it settles exactly once (`Settlement`)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.gateway.inputs import RequestInfo
from agent.gateway.limits import QuotaGate
from agent.gateway.pipeline_route import PipelineHop
from agent.gateway.plan import Attempt
from agent.gateway.quota import Reservation
from agent.gateway.spans import RequestTrace
from fleet_base.protocol import UsageRecord

if TYPE_CHECKING:
    from agent.gateway.shadow import ShadowCopy


@dataclass(frozen=True)
class ClientHeaders:
    """What of the client's headers travels on: to a peer gateway, and back to a peer."""

    authorization: str = ""  # the client's key: carried only without credentials (a token vouches)
    session: str | None = None  # the user's canary side (X-Fleet-Session)
    hops: int = 0  # gateways the request passed before this one
    keep_ids: bool = False  # a peer gateway asked for the token ids (it may migrate)


@dataclass(frozen=True)
class Call:
    """One admitted request: who sent it, what it asks, how it routes. Never changes."""

    request_id: str
    key_id: str
    info: RequestInfo
    started: float
    forwarded_from: str | None = None
    adapter: str | None = None  # the LoRA adapter the request names ("model"), if any
    klass: str = ""  # priority class
    max_concurrent: int | None = None  # the key's: its requests holding a slot here at once
    draw: float | None = None  # the canary draw (sticky per end user), fixed per request
    block_keys: tuple[int, ...] = ()  # the prompt's prefix-block keys (prefix routing)
    salted: bool = True  # the deployment's engine takes the key's cache salt (agent.gateway.tenancy)
    limit_headers: Mapping[str, str] = field(default_factory=dict)
    client: ClientHeaders = ClientHeaders()
    allowed: frozenset[str] | None = None  # residency: where it may be processed (None: anywhere)
    pipeline: PipelineHop | None = None  # a hop of a pipeline request: where it may go
    local_only: bool = False  # served by this cluster's replicas only, never sent to a peer
    # a batch line or async request: its usage record's id, the same on every run of the line
    batch_record: str | None = None
    # a batch line's or async request's usage record is put here, not published: the worker
    # books it only when its result is the one stored (`put_result` won)
    held: list[UsageRecord] | None = field(default=None, compare=False, repr=False)
    trace: RequestTrace = field(default_factory=RequestTrace, compare=False, repr=False)  # its spans

    @property
    def deployment(self) -> str:
        return self.info.deployment


@dataclass
class Progress:
    """What serving the request changes: who answered, when, and what it reported."""

    version: int | None = None
    peer: str | None = None  # the peer gateway that answered (it records the usage)
    ran: bool = False  # a replica answered 2xx: it may have generated tokens
    ttft_s: float | None = None  # a stream's, measured here
    # A non-streamed answer's, from its arrival here: the time before the upstream call plus
    # what the upstream reported (`fleet_base.openai_contract.timing`); None if it said nothing usable.
    reported_ttft_s: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    admitted: bool = False  # holds a slot of the queue's concurrency target
    queue_s: float = 0.0
    finished: bool = False
    itl_s: float | None = None  # a stream's mean inter-token latency
    record_id: str = field(default_factory=lambda: secrets.token_hex(12))  # its usage record's


class Settlement:
    """A request's quota reservation, settled exactly once whatever path it took: to
    nothing when a peer gateway's answer is taken (that gateway charges the key), else
    to the engine's usage when the request is finished; either way plus what the
    attempts this gateway abandoned cost (`abandoned`)."""

    def __init__(self, gate: QuotaGate, reservation: Reservation | None) -> None:
        self.gate = gate
        self.reservation = reservation
        self.settled = False
        self.abandoned_tokens = 0  # charged on top of the answer's usage

    def abandoned(self, tokens: int) -> None:
        """An attempt sent to a replica here was given up (its deadline passed, or the
        client left) before it reported usage: it may have run, so the key pays for it."""
        if not self.settled:
            self.abandoned_tokens += tokens

    def elsewhere(self) -> None:
        if not self.settled:
            self.settled = True
            self.gate.settle(self.reservation, {}, False, self.abandoned_tokens)

    def settle(self, usage: dict[str, Any], ran: bool) -> None:
        if not self.settled:
            self.settled = True
            self.gate.settle(self.reservation, usage, ran, self.abandoned_tokens)


@dataclass
class Exchange:
    """A request in flight: the fixed call, its progress, its settlement."""

    call: Call
    settlement: Settlement
    progress: Progress = field(default_factory=Progress)
    shadow: ShadowCopy | None = None  # its copy to the shadow version, while one runs

    def abandoned(self, target: Attempt) -> int:
        """`target` was given up after the request was sent: what the key pays for it here
        (its prompt; nothing for a peer gateway, which charges its own attempts)."""
        if target.charge != "here":
            return 0
        tokens = self.call.info.prompt_tokens
        self.settlement.abandoned(tokens)
        return tokens

    def took(self, target: Attempt, status: int, *, continuation: bool = False) -> None:
        """`target`'s answer is the client's now (a first leg or a stream's continuation)."""
        p = self.progress
        p.version = target.version
        if target.charge == "elsewhere":
            self.settlement.elsewhere()
            p.peer = target.name
        elif continuation:
            p.ran = True
        else:
            p.peer, p.ran = None, 200 <= status < 300
