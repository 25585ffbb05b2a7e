"""Reading the placement the reconcile pass wrote, for the rollout tests."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from control_plane.db import models as m


def assignments_by(sessions: Any, field: str) -> dict[Any, int]:
    """Replica assignments counted by one of their fields (version, cluster_id, ...)."""
    with sessions() as s:
        out: dict[Any, int] = {}
        for a in s.scalars(select(m.ReplicaAssignment)):
            key = getattr(a, field)
            out[key] = out.get(key, 0) + 1
        return out
