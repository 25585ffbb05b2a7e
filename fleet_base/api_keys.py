"""API keys as gateways see them (KV bucket `fleet_keys`): the salted hash of each key, its
scopes and quotas, the set's lease, and how a secret is made and checked. The control plane
writes these records; gateways verify a request's bearer secret against them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from pydantic import BaseModel, ConfigDict, Field

from fleet_base.domain import PriorityClassName
from fleet_base.protocol import Epoch, Message


class DeploymentLimits(BaseModel):
    """A key's limits on one deployment, on top of its overall limits (None: unlimited)."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_minute: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)


class Quotas(BaseModel):
    """Per-key limits; None means unlimited. Enforced by gateways (docs/quotas.md)."""

    tokens_per_minute: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-10, le=10)
    tokens_per_day: int | None = Field(None, ge=1)
    # deployment name -> limits on that deployment alone
    deployments: dict[str, DeploymentLimits] = Field(default_factory=dict)
    # the gateway's queueing class (e.g. "interactive" over "batch"); None: its default class
    priority_class: PriorityClassName | None = None

    def limited(self) -> bool:
        """Whether any token or request rate applies (gateways then send x-ratelimit-* headers)."""
        own = (self.tokens_per_minute, self.requests_per_minute, self.tokens_per_day)
        per = [
            v
            for d in self.deployments.values()
            for v in (d.tokens_per_minute, d.requests_per_minute, d.tokens_per_day)
        ]
        return any(v is not None for v in (*own, *per))


class ApiKeyRecord(Message):
    """An inference or admin key as gateways see it: the salted hash, never the secret."""

    key_id: str
    name: str
    salt: str
    hash: str
    scopes: list[str] = Field(default_factory=lambda: ["inference"])
    deployments: list[str] | None = None  # None: every deployment
    quotas: Quotas = Field(default_factory=Quotas)
    # cluster id -> this cluster's fraction of the key's token budgets, set by the control
    # plane from recent usage; empty: every gateway enforces the whole budget (docs/quotas.md)
    shares: dict[str, float] = Field(default_factory=dict)
    revoked: bool = False
    created_at: float = Field(default_factory=time.time)
    # The jurisdictions this key's requests may be processed in (None: no policy); a gateway
    # outside them refuses the key (fleet_base.residency).
    residency: list[str] | None = None
    # The team the key's usage is charged to (docs/cost.md); None: no team.
    team: str | None = None
    # Set by the control plane while the key's team has a hard monthly budget that is
    # spent: a gateway then refuses the key's new requests (429 insufficient_quota).
    budget_exhausted: bool = False
    # The version of the key's webhook signing secret (fleet_base.batch.webhook_signing):
    # rotating the secret raises it, and gateways sign with the new one at the next publish.
    webhook_secret_version: int = Field(0, ge=0)
    epoch: Epoch = 0  # fleet_base.protocol.Epoch

    def allows(self, deployment: str) -> bool:
        return self.deployments is None or deployment in self.deployments


# A reserved entry of `fleet_keys` (key ids are hex, so it never collides): the control
# plane renews it every few seconds whether or not a key changed, so an agent and its
# gateway can tell a current key set from one that stopped being updated.
KEYS_LEASE = "_lease"


class KeyLease(Message):
    """The key set's lease: valid for `valid_s` from `issued_at` (the issuer's clock)."""

    issued_at: float = Field(default_factory=time.time)
    valid_s: float = Field(15.0, gt=0)
    keys: int = Field(0, ge=0)  # live keys in the set when issued
    epoch: Epoch = 0  # fleet_base.protocol.Epoch


KEY_PREFIX = "fleet"


def new_secret(key_id: str | None = None) -> tuple[str, str]:
    """A new (key_id, secret). The secret embeds the id ("fleet-<id>-<random>") so a
    verifier finds the record in O(1) before checking the salted hash."""
    key_id = key_id or secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(24)}"


def key_id_of(secret: str) -> str | None:
    parts = secret.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1]:
        return None
    return parts[1]


def hash_secret(secret: str, salt: str | None = None) -> tuple[str, str]:
    """(salt, hex digest). Keys are 192-bit random, so a keyed SHA-256 suffices; a slow
    KDF would only cost every gateway request."""
    salt = salt or secrets.token_hex(16)
    digest = hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()
    return salt, digest


def verify_secret(secret: str, salt: str, digest: str) -> bool:
    return hmac.compare_digest(hash_secret(secret, salt)[1], digest)
