"""What the control plane's parts share in one process: settings, the database session
factory, the NATS link, and a way for API writes to wake the control loops at once
instead of waiting for their next tick."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from control_plane.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from fleet_base.nats_io import NatsLink


@dataclass
class ControlPlaneContext:
    settings: Settings
    sessions: sessionmaker[Session]
    nats: NatsLink | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set with `changed`: the key loop publishes fleet_keys apart from placement.
    keys_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The leader's fencing epoch while this context drives the control loops (0: not the
    # leader, or a context that never runs loops). Every write the loops make carries it.
    epoch: int = 0
    # Called on every kick (on the event loop): the elector forwards a follower's kicks to
    # the leader (control_plane.ha.elector).
    on_kick: Callable[[], None] | None = None
    # Called with an epoch seen on the wire above `epoch` (a bucket's value, an agent's
    # fence) and where it was seen: the elector raises the lease above it or steps down.
    on_wire_epoch: Callable[[int, str], None] | None = None

    def saw_epoch(self, epoch: int, where: str) -> None:
        """An epoch seen on the wire: above ours, the elector must hear of it."""
        if epoch > self.epoch and self.on_wire_epoch is not None:
            self.on_wire_epoch(epoch, where)

    def kick(self) -> None:
        """Desired state may have changed: reconcile now."""
        self.changed.set()
        self.keys_changed.set()
        if self.on_kick is not None:
            self.on_kick()
