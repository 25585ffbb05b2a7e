"""Fleet's domain names: each identifier more than one layer checks, with its one rule.

A cluster id is a NATS subject token and a KV key, so the admin API, the agent's
`cluster.yaml`, enrollment and the wire decoder accept exactly the same ones: a cluster
the API registers is one whose agent can heart-beat. Each rule is a pattern string, the
one source of both the Pydantic type and the plain check.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

CLUSTER_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"

# A cluster id: lowercase letters, digits and dashes, 1-63 characters.
ClusterId = Annotated[str, StringConstraints(pattern=CLUSTER_ID_PATTERN)]


def is_cluster_id(value: str) -> bool:
    """Whether `value` follows the cluster id rule (for checks outside a Pydantic model)."""
    return re.fullmatch(CLUSTER_ID_PATTERN, value) is not None
