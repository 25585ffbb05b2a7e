"""A cluster's credential files (`cluster.yaml` `security:`) and the TLS contexts made
from them. Empty paths mean "no TLS" (tests, or a deployment that terminates TLS
elsewhere); `fleetctl up` and `fleetctl clusters enroll` always fill them in."""

from __future__ import annotations

import ssl
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator


class Credentials(BaseModel):
    """Paths of one cluster's credential bundle (all PEM; keys and the token 0600)."""

    model_config = ConfigDict(extra="forbid")

    ca_file: Path | None = None  # the fleet CA: verifies NATS, peers, replicas
    agent_cert: Path | None = None  # the agent's NATS identity
    agent_key: Path | None = None
    gateway_cert: Path | None = None  # the gateway's NATS identity, HTTPS peer listener, peer tokens
    gateway_key: Path | None = None
    replica_cert: Path | None = None  # HTTPS server certificate of this cluster's replicas
    replica_key: Path | None = None
    replica_token_file: Path | None = None  # bearer secret replicas require (only gateway and agent hold it)
    webhook_master_file: Path | None = (
        None  # the fleet's webhook master secret (fleet_base.batch.webhook_signing)
    )

    @field_validator("*")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return Path(value).expanduser() if value else None

    @property
    def enabled(self) -> bool:
        return self.ca_file is not None

    @cached_property
    def replica_token(self) -> str | None:
        if self.replica_token_file is None:
            return None
        return self.replica_token_file.read_text().strip() or None


def client_context(ca_file: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """Verifies servers against the fleet CA (hostnames included); presents `cert` when given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def server_context(cert: Path, key: Path, ca_file: Path | None = None) -> ssl.SSLContext:
    """Serves `cert`; with `ca_file`, also requires a client certificate from the fleet CA."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if ca_file is not None:
        ctx.load_verify_locations(cafile=str(ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class NatsTls(BaseModel):
    """How one identity connects to NATS: the fleet CA, its certificate and key, and the
    inbox prefix its NATS user may subscribe to. Absent: a plaintext, anonymous link."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    inbox_prefix: str

    def context(self) -> ssl.SSLContext:
        return client_context(self.ca_file, self.cert_file, self.key_file)


def nats_tls(creds: Credentials, role: str, cluster: str) -> NatsTls | None:
    """The agent's or gateway's NATS credentials from its cluster bundle."""
    from fleet_base.security.identity import inbox_prefix

    if not creds.enabled:
        return None
    cert, key = (
        (creds.agent_cert, creds.agent_key) if role == "agent" else (creds.gateway_cert, creds.gateway_key)
    )
    if cert is None or key is None or creds.ca_file is None:
        raise ValueError(f"security.ca_file is set but the {role} certificate or key is missing")
    prefix = inbox_prefix("agent" if role == "agent" else "gateway", cluster)
    return NatsTls(ca_file=creds.ca_file, cert_file=cert, key_file=key, inbox_prefix=prefix)


def replica_verify(creds: Credentials) -> ssl.SSLContext | bool:
    """httpx `verify=` for calls to this cluster's replicas (the fleet CA), True without TLS."""
    return client_context(creds.ca_file) if creds.enabled and creds.ca_file else True
