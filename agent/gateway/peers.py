"""Who sent a request, and what the gateway presents upstream.

With the cluster's credentials (`security:` in cluster.yaml), a request counts as a
peer's only when it arrived on the peer listener (HTTPS, mutual TLS with the fleet CA)
and carries a valid peer token (`agent.security.peer_token`); every other request is a
client's, whatever `X-Fleet-*` headers it sends. Without credentials (tests, a trusted
network) the old rule stands: the `X-Fleet-Forwarded` header is believed.

Upstream, the gateway verifies replicas and peers against the fleet CA, presents its
own certificate (peers require it), sends replicas the cluster's replica token and
peers a fresh peer token per attempt.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from agent.gateway.routing import HOPS_HEADER, forwarded_from
from agent.security.peer_token import PeerSigner, PeerTokenError, PeerVerifier
from agent.security.replica_auth import replica_headers
from fleet_base.cluster_config import ClusterConfig
from fleet_base.security.tls import client_context

log = logging.getLogger("agent.gateway")

PEER_TOKEN_HEADER = "x-fleet-peer-token"
PEER_LISTENER = "fleet.peer_listener"  # ASGI scope key set by the peer listener's wrapper


def mark_peer_listener(app: Any) -> Any:
    """The ASGI app the peer listener serves: the same app, with requests marked."""

    async def peer_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, PEER_LISTENER: True}
        await app(scope, receive, send)

    return peer_app


class PeerAuth:
    def __init__(self, config: ClusterConfig, registry: CollectorRegistry | None = None) -> None:
        creds = config.security
        self.cluster = config.cluster
        self.secure = creds.enabled
        self.signer: PeerSigner | None = None
        self.verifier: PeerVerifier | None = None
        self.replica_headers = replica_headers(creds)
        self.rejected = Counter(
            "fleet_gateway_peer_auth_failures_total",
            "Requests on the peer listener whose peer token did not verify (served as a client's)",
            registry=registry,
        )
        # httpx `verify=` for replicas and peers: the fleet CA, presenting our certificate
        self.client_verify: ssl.SSLContext | bool = True
        if self.secure:
            assert creds.ca_file is not None
            self.verifier = PeerVerifier(creds.ca_file, config.cluster)
            if creds.gateway_cert and creds.gateway_key:
                self.signer = PeerSigner(creds.gateway_cert, creds.gateway_key)
            self.client_verify = client_context(creds.ca_file, creds.gateway_cert, creds.gateway_key)

    def origin(
        self, scope: Mapping[str, Any], headers: Mapping[str, str], forwarded_header: str
    ) -> str | None:
        """The authenticated peer cluster a request came from, or None: a client's."""
        if not self.secure:
            return forwarded_from(headers, forwarded_header)
        token = headers.get(PEER_TOKEN_HEADER)
        if not scope.get(PEER_LISTENER) or not token or self.verifier is None:
            return None
        try:
            return self.verifier.verify(token, headers.get("x-request-id"))
        except PeerTokenError as err:
            self.rejected.inc()
            log.warning("treating a request with a bad peer token as a client's: %s", err)
            return None

    def usable(self, peer_url: str) -> bool:
        """A secured gateway forwards users' keys and prompts only over HTTPS."""
        return not self.secure or peer_url.startswith("https://")

    def hops(self, origin: str | None, headers: Mapping[str, str]) -> str | None:
        """The hop count to build on: a client's own claim counts for nothing."""
        return headers.get(HOPS_HEADER) if origin is not None else None

    def to_peer(self, peer: str, request_id: str) -> dict[str, str]:
        return {PEER_TOKEN_HEADER: self.signer.sign(peer, request_id)} if self.signer else {}
