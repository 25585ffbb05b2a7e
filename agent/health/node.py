"""Which node this agent's replicas run on, when the runtime does not say (process, sim)."""

from __future__ import annotations

import re
import socket


def host_node_name(configured: str = "") -> str:
    """`configured` (ClusterConfig.node_name) when set, else this host's name reduced to
    the NodeName pattern (characters outside it become "-")."""
    name = configured or socket.gethostname()
    name = re.sub(r"[^A-Za-z0-9._\-]", "-", name)[:253].lstrip("._-")
    return name or "localhost"
