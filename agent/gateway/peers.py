"""Who sent a request, and what the gateway presents upstream.

With the cluster's credentials (`security:` in cluster.yaml) the peer listener (HTTPS,
mutual TLS with the fleet CA) serves peer gateways only: a request there is a forward,
and it is served only when its peer token verifies (`agent.security.peer_token`), within
the hop limit; otherwise it is refused (401/403), never served as a client's request,
so a failing token cannot bounce between two gateways. A peer token sent to the client
port is refused too; any other `X-Fleet-*` header a client sends counts for nothing.
The forwarding gateway never sends the user's key: it vouches, inside the signed token,
for the id of the key it verified, and the peer accepts that only for a key of its own
key set (`Authenticator.vouched`), whose quotas it then applies as usual.
Without credentials (tests, a trusted network) the old rule stands: the
`X-Fleet-Forwarded` header is believed and the user's key travels with the request.

Upstream, the gateway verifies replicas and peers against the fleet CA, presents its
own certificate (peers require it), sends replicas the cluster's replica token and
peers a fresh peer token per attempt.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry, Counter

from agent.gateway.auth import Authenticator
from agent.gateway.errors import GatewayError
from agent.gateway.exchange import Call
from agent.gateway.routing import FORWARDED_HEADER, HOPS_HEADER, MAX_HOPS, forwarded_from, hops_of
from agent.security.peer_token import PeerSigner, PeerTokenError, PeerVerifier
from agent.security.replica_auth import replica_headers
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig
from fleet_base.security.tls import client_context

log = logging.getLogger("agent.gateway")

PEER_TOKEN_HEADER = "x-fleet-peer-token"
PEER_LISTENER = "fleet.peer_listener"  # ASGI scope key set by the peer listener's wrapper


@dataclass(frozen=True)
class PeerForward:
    """A request another gateway forwarded here: served here, never sent on."""

    cluster: str  # the forwarding gateway's cluster
    hops: int  # gateways it passed, the forwarding one included
    key_id: str | None = None  # the key that gateway verified and vouches for; None: the key came along


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
            "Forwards whose peer token did not verify (each was refused)",
            registry=registry,
        )
        self.refusals = Counter(
            "fleet_gateway_peer_refusals_total",
            "Requests claiming to be a peer's forward that were refused, by reason",
            ["reason"],
            registry=registry,
        )
        self.received = Counter(
            "fleet_gateway_peer_forwards_received_total",
            "Forwards accepted from peer gateways, by the cluster that vouched for the key",
            ["peer"],
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

    def forward(self, scope: Mapping[str, Any], headers: Mapping[str, str]) -> PeerForward | None:
        """The authenticated forward a request is, or None: a client's request. A request
        that claims to be a forward and is not one raises GatewayError (401/403)."""
        if not self.secure:
            sender = forwarded_from(headers, FORWARDED_HEADER)
            return None if sender is None else PeerForward(sender, hops_of(headers.get(HOPS_HEADER)))
        token = headers.get(PEER_TOKEN_HEADER)
        if not scope.get(PEER_LISTENER):
            if token:
                self._refuse("wrong_listener", 401, "A peer token is accepted only on the peer listener")
            return None
        if not token or self.verifier is None:
            self._refuse(
                "token_missing",
                401,
                "The peer listener serves only peer gateways' forwards, with an X-Fleet-Peer-Token",
            )
        try:
            claim = self.verifier.verify(token, headers.get("x-request-id"))
        except PeerTokenError as err:
            self.rejected.inc()
            log.warning("refused a forward whose peer token did not verify: %s", err)
            self._refuse("token_invalid", 401, f"The peer token was rejected: {err}")
        if not 1 <= claim.hops <= MAX_HOPS:
            self._refuse(
                "hop_limit",
                403,
                f"A forward from cluster '{claim.cluster}' claims {claim.hops} hops; a forwarded "
                f"request is served where it lands (at most {MAX_HOPS})",
            )
        self.received.labels(claim.cluster).inc()
        return PeerForward(claim.cluster, claim.hops, claim.key_id)

    def key(
        self, auth: Authenticator, forward: PeerForward | None, authorization: str | None
    ) -> ApiKeyRecord:
        """The request's key: the one a peer vouched for, else the client's own."""
        if forward is None or forward.key_id is None:
            return auth.authenticate(authorization)
        try:
            return auth.vouched(forward.key_id, forward.cluster)
        except GatewayError as err:
            if err.code == "vouched_key_unknown":
                self.refusals.labels("key_unknown").inc()
            raise

    def _refuse(self, reason: str, status: int, message: str) -> NoReturn:
        self.refusals.labels(reason).inc()
        raise GatewayError(status, message, code=REFUSAL_CODES[reason])

    def carried_authorization(self, headers: Mapping[str, str]) -> str:
        """What of the client's credential a forward may carry: nothing with credentials
        (the token vouches instead), the header itself on an unsecured, trusted network."""
        return "" if self.secure else headers.get("authorization", "")

    def usable(self, peer_url: str) -> bool:
        """A secured gateway forwards prompts only over HTTPS, and only when it can sign."""
        return not self.secure or (peer_url.startswith("https://") and self.signer is not None)

    def to_peer(self, peer: str, call: Call) -> dict[str, str]:
        """Headers that make `call` a forward to `peer`, one hop further."""
        hops = call.client.hops + 1
        headers = {FORWARDED_HEADER: self.cluster, HOPS_HEADER: str(hops)}
        if self.signer is not None:
            headers[PEER_TOKEN_HEADER] = self.signer.sign(
                peer, call.request_id, key_id=call.key_id, hops=hops
            )
        elif not self.secure:
            headers["authorization"] = call.client.authorization
        return headers


REFUSAL_CODES = {
    "wrong_listener": "peer_token_misplaced",
    "token_missing": "peer_token_missing",
    "token_invalid": "peer_token_invalid",
    "hop_limit": "peer_hop_limit",
}
