"""The control plane's inbox: the core-NATS messages agents and gateways send it
(heartbeats, demand), each decoded once (`fleet_base.wire`) and handed, typed, to
every loop that asked for that kind.

Before it, the reconcile loop and the autoscaler each subscribed to heartbeats and
decoded them with their own rules. A message longer than its kind allows, or past its
cluster's budget of messages and bytes per second (`INTAKE`, `fleet_base.intake`), is
refused before it is parsed (reasons "size" and "rate"). A refused message is counted once, in the shared
`Rejections` (`fleet_control_plane_rejected_messages_total`). Durable streams (events,
stored usage) are read by their consumers (`loops.durable`), and live usage by the
rollout loop (its only reader, which replays the stream before it), with the same decoders.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from control_plane.counters import Rejections
from control_plane.nats_loop import Handler, NatsLoop
from fleet_base import protocol
from fleet_base.intake import Intake
from fleet_base.wire import Rejected, decode_demand, decode_heartbeat

log = logging.getLogger(__name__)

M = TypeVar("M")
Receiver = Callable[[M], Awaitable[None] | None]

# kind -> (subject pattern, decoder, counted in Rejections)
_KINDS: dict[str, tuple[str, Callable[[str, bytes], Any], bool]] = {
    "heartbeat": (protocol.HEARTBEAT_WILDCARD, decode_heartbeat, True),
    "demand": (protocol.DEMAND_WILDCARD, decode_demand, False),
}
# kind -> (largest message, messages/s, bytes/s) one cluster may send before parsing is
# refused: heartbeats come every second (tests: every 0.5 s), demand at most every 0.5 s
# per deployment plus one per queued request.
INTAKE: dict[str, tuple[int, float, float]] = {
    "heartbeat": (1 << 20, 20.0, 4 * (1 << 20)),
    "demand": (64 << 10, 200.0, 1 << 20),
}


class Inbox(NatsLoop):
    """Subscribes (once per connection) to the kinds some loop receives; decodes each
    message once and calls the receivers in the order they registered."""

    def __init__(self, ctx: Any, rejections: Rejections | None = None) -> None:
        super().__init__(ctx)
        self.rejections = rejections if rejections is not None else Rejections()
        self._receivers: dict[str, list[Receiver]] = {kind: [] for kind in _KINDS}
        self.intake = {kind: Intake(*INTAKE[kind]) for kind in _KINDS}
        self.subscribed: set[str] = set()

    def receive(self, kind: str, receiver: Receiver) -> None:
        """Hand every accepted message of `kind` ("heartbeat", "demand") to
        `receiver`; on a live connection a kind nobody received before is subscribed now."""
        self._receivers[kind].append(receiver)
        if self._subscribed_nc is not None and kind not in self.subscribed:
            self.subscribed.add(kind)
            self._spawn(self._subscribe(kind), name=f"cp-inbox-{kind}")

    async def _subscribe(self, kind: str) -> None:
        nc: Any = self._subscribed_nc
        self._subs.append(await nc.subscribe(_KINDS[kind][0], cb=self._handler(kind)))

    async def start(self) -> Inbox:
        await self._listen()
        return self

    async def stop(self) -> None:
        await self._close()

    def _subscriptions(self) -> list[tuple[str, Handler]]:
        kinds = [kind for kind, receivers in self._receivers.items() if receivers]
        self.subscribed = set(kinds)
        return [(_KINDS[kind][0], self._handler(kind)) for kind in kinds]

    def _handler(self, kind: str) -> Handler:
        async def handle(msg: Any) -> None:
            await self.deliver(kind, msg.subject, msg.data)

        return handle

    async def deliver(self, kind: str, subject: str, data: bytes) -> bool:
        """Decode one message of `kind` and hand it on; False when it was refused."""
        pattern, decoder, counted = _KINDS[kind]
        refusal = self.intake[kind].refusal(subject, data)  # cheap, before the parse
        if refusal is not None:
            self.rejections.reject(pattern, refusal, subject, f"{len(data)} bytes")
            return False
        try:
            message = decoder(subject, data)
        except Rejected as err:
            if counted:
                self.rejections.reject(pattern, err.reason, subject, err.detail)
            return False
        for receiver in self._receivers[kind]:
            try:
                result = receiver(message)
                if result is not None:
                    await result
            except Exception:
                log.exception("a %s receiver failed", kind)
        return True
