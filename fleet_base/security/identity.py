"""Who is who in the fleet: the identity names every certificate carries.

Each process has one X.509 identity issued by the fleet CA. The subject's common name
names the role and, for agents and gateways, the cluster; nats-server maps the subject to
a NATS user (`verify_and_map`), gateways read the role from a peer token's certificate.
A URI SAN (`spiffe://fleet/<role>/<cluster>`) says the same for tools that prefer SANs.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["control-plane", "agent", "gateway", "replica", "nats"]
TRUST_DOMAIN = "fleet"


def common_name(role: Role, cluster: str | None = None) -> str:
    return f"fleet-{role}" if cluster is None else f"fleet-{role}.{cluster}"


def subject_dn(role: Role, cluster: str | None = None) -> str:
    """The subject as nats-server's verify_and_map matches it: one RDN, no ordering doubt."""
    return f"CN={common_name(role, cluster)}"


def spiffe_id(role: Role, cluster: str | None = None) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{role}" + (f"/{cluster}" if cluster else "")


def parse_spiffe_id(uri: str) -> tuple[str, str | None] | None:
    """(role, cluster) of a fleet SPIFFE id, or None for anything else."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix) :].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    return None


def inbox_prefix(role: Role, cluster: str | None = None) -> str:
    """The reply-subject prefix of one identity: its NATS user may subscribe only there,
    so no client hears another's replies."""
    return f"_INBOX.{role}" + (f".{cluster}" if cluster else "")
