"""Bearer-key authentication and authorization against the cluster's key set.

Keys are `fleet-<key_id>-<secret>`: the id finds the record, the salted hash proves the
secret. A successful check is cached briefly by the secret's own digest; a cache hit is
still checked against the current record, so revocation or rotation (a new salt/hash in
keys.json) takes effect on the next reload, not when the cache entry expires.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agent.gateway.errors import GatewayError
from agent.gateway.freshness import KeyFreshness
from fleet_base.api_keys import ApiKeyRecord, key_id_of, verify_secret

# An admin key (the bootstrap token above all) manages the fleet; it never runs inference.
INFERENCE_SCOPES = frozenset({"inference"})
METRICS_SCOPES = frozenset({"metrics", "read", "admin"})


@dataclass(frozen=True)
class _Verified:
    key_id: str
    salt: str
    hash: str
    until: float


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="fleet"'}
    )


def bearer_secret(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


class Authenticator:
    """Turns an Authorization header into the key's record, or a 401/403."""

    def __init__(
        self,
        keys: Callable[[], Mapping[str, ApiKeyRecord]],
        *,
        cache_ttl_s: float = 30.0,
        max_cached: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        freshness: KeyFreshness | None = None,
    ) -> None:
        self.keys = keys
        self.freshness = freshness  # None: the key set is trusted however old
        self.cache_ttl_s = cache_ttl_s
        self.max_cached = max_cached
        self.clock = clock
        self._cache: dict[str, _Verified] = {}

    def authenticate(self, authorization: str | None) -> ApiKeyRecord:
        secret = bearer_secret(authorization)
        if secret is None:
            raise _unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>' with a key from 'fleetctl keys create'"
            )
        key_id = key_id_of(secret)
        record = self.keys().get(key_id) if key_id else None
        if record is None or record.key_id != key_id:
            raise _unauthorized("Incorrect API key provided")
        if record.revoked:
            raise _unauthorized("This API key has been revoked")
        digest = hashlib.sha256(secret.encode()).hexdigest()
        now = self.clock()
        hit = self._cache.get(digest)
        if (
            hit
            and hit.until > now
            and hit.key_id == key_id
            and (hit.salt, hit.hash) == (record.salt, record.hash)
        ):
            return self._fresh_enough(record)
        if not verify_secret(secret, record.salt, record.hash):
            self._cache.pop(digest, None)
            raise _unauthorized("Incorrect API key provided")
        if len(self._cache) >= self.max_cached:
            self._cache.clear()
        self._cache[digest] = _Verified(key_id, record.salt, record.hash, now + self.cache_ttl_s)
        return self._fresh_enough(record)

    def vouched(self, key_id: str, peer: str) -> ApiKeyRecord:
        """The record of a key an authenticated peer gateway verified and vouches for (it
        sends the key's id, never the secret): trusted only for a key this cluster knows and
        has not revoked, and under the same freshness rule as a key checked here."""
        record = self.keys().get(key_id)
        if record is None or record.key_id != key_id or record.revoked:
            raise GatewayError(
                401,
                f"The peer gateway of cluster '{peer}' vouched for API key '{key_id}', which this "
                "cluster does not know or has revoked",
                code="vouched_key_unknown",
            )
        return self._fresh_enough(record)

    def _fresh_enough(self, record: ApiKeyRecord) -> ApiKeyRecord:
        if self.freshness is not None:
            self.freshness.admit(record)
        return record

    @staticmethod
    def authorize_metrics(record: ApiKeyRecord) -> None:
        if not METRICS_SCOPES.intersection(record.scopes):
            raise GatewayError(
                403,
                f"API key '{record.key_id}' lacks the 'metrics' or 'read' scope",
                code="insufficient_scope",
            )

    @staticmethod
    def authorize(record: ApiKeyRecord, deployment: str | None = None) -> None:
        """403 unless the key may run inference (on `deployment`, when given)."""
        if not INFERENCE_SCOPES.intersection(record.scopes):
            raise GatewayError(
                403,
                f"API key '{record.key_id}' lacks the 'inference' scope (it has: {', '.join(record.scopes) or 'none'})",
                code="insufficient_scope",
            )
        if deployment is not None and not record.allows(deployment):
            raise GatewayError(
                403,
                f"API key '{record.key_id}' is not allowed to use the model '{deployment}'",
                param="model",
                code="model_not_allowed",
            )
