"""Signed, short-lived peer tokens: how one gateway proves to another that a forwarded
request comes from it, and vouches for the API key it verified.

A token is a JWT (ES256, PyJWT) signed with the forwarding gateway's private key; its
header carries that gateway's certificate (`x5c`). The receiver accepts it only when
the certificate was issued by a CA of the fleet's trust file (every CA of the bundle:
old and new during a rotation), is valid now, names the gateway role and a cluster (URI
SAN `spiffe://fleet/gateway/<cluster>`), the signature checks out, the audience is the
receiving cluster, the request id matches the request it came with, and it is at most
`TOKEN_TTL_S` old. Its claims `key` (the id of the API key the forwarding gateway
verified; never the secret, so a peer never holds a credential valid elsewhere) and
`hops` (gateways the request has passed, this one included) are signed with the rest. Why tokens on top of mutual TLS: the TLS layer
proves a fleet certificate, but uvicorn does not hand the application the client
certificate, so only the token tells the request path *which* gateway forwarded (and
that it is a gateway, not an agent); it also survives a TLS-terminating proxy.
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fleet_base.security.ca_bundle import issuer_in, load_bundle
from fleet_base.security.identity import parse_spiffe_id

TOKEN_TTL_S = 60.0
LEEWAY_S = 5.0
MAX_KEY_ID = 128  # characters of a vouched key id (ids are short hex; anything longer is not one)


class PeerTokenError(Exception):
    pass


@dataclass(frozen=True)
class PeerClaim:
    """What a verified token says: who forwarded, for which key, after how many hops."""

    cluster: str  # the forwarding gateway's cluster (from its certificate)
    key_id: str  # the API key it verified and vouches for
    hops: int  # gateways passed, the forwarding one included


def _cluster_of(cert: x509.Certificate, role: str = "gateway") -> str:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PeerTokenError("certificate has no subject alternative names") from None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        parsed = parse_spiffe_id(uri)
        if parsed and parsed[0] == role and parsed[1]:
            return parsed[1]
    raise PeerTokenError(f"certificate does not name a fleet {role}")


class PeerSigner:
    def __init__(self, cert_file: Path, key_file: Path) -> None:
        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
        key = serialization.load_pem_private_key(Path(key_file).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the gateway key must be an EC key (ES256)")
        self.cluster = _cluster_of(cert)
        self._key = key
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()

    def sign(
        self, audience: str, request_id: str, *, key_id: str, hops: int, now: float | None = None
    ) -> str:
        now = time.time() if now is None else now
        claims = {
            "iss": self.cluster,
            "aud": audience,
            "iat": int(now),
            "exp": int(now + TOKEN_TTL_S),
            "rid": request_id,
            "key": key_id,
            "hops": hops,
        }
        return jwt.encode(claims, self._key, algorithm="ES256", headers={"x5c": [self._x5c]})


class PeerVerifier:
    def __init__(self, ca_file: Path, cluster: str, max_cached: int = 256) -> None:
        self.cas = load_bundle(ca_file)
        self.cluster = cluster
        self.max_cached = max_cached
        self._certs: dict[str, tuple[x509.Certificate, str]] = {}  # DER sha256 -> (cert, cluster)

    def _certificate(self, der_b64: str) -> tuple[x509.Certificate, str]:
        try:
            der = base64.b64decode(der_b64, validate=True)
        except (ValueError, TypeError):
            raise PeerTokenError("x5c is not base64") from None
        fingerprint = hashlib.sha256(der).hexdigest()
        hit = self._certs.get(fingerprint)
        if hit is None:
            try:
                cert = x509.load_der_x509_certificate(der)
            except ValueError:
                raise PeerTokenError("x5c is not a DER certificate") from None
            if issuer_in(cert, self.cas) is None:
                raise PeerTokenError("certificate not issued by a CA of the fleet's trust file")
            hit = (cert, _cluster_of(cert))
            if len(self._certs) >= self.max_cached:
                self._certs.clear()
            self._certs[fingerprint] = hit
        cert, cluster = hit
        now = time.time()
        if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
            raise PeerTokenError("certificate expired or not yet valid")
        return cert, cluster

    def verify(self, token: str, request_id: str | None) -> PeerClaim:
        """Who forwarded, for which key, after how many hops; PeerTokenError for anything else."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as err:
            raise PeerTokenError(f"malformed token ({err})") from None
        chain = header.get("x5c")
        if (
            header.get("alg") != "ES256"
            or not isinstance(chain, list)
            or not chain
            or not isinstance(chain[0], str)
        ):
            raise PeerTokenError("token needs alg ES256 and an x5c certificate")
        cert, cluster = self._certificate(chain[0])
        try:
            claims = jwt.decode(
                token,
                cert.public_key(),
                algorithms=["ES256"],
                audience=self.cluster,
                issuer=cluster,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "iss", "aud", "rid", "key", "hops"]},
            )
        except jwt.PyJWTError as err:
            raise PeerTokenError(f"token rejected ({err})") from None
        if claims["iat"] > time.time() + LEEWAY_S or claims["exp"] - claims["iat"] > TOKEN_TTL_S + LEEWAY_S:
            raise PeerTokenError("token lifetime out of bounds")
        if request_id is None or claims["rid"] != request_id:
            raise PeerTokenError("token is for another request")
        key_id, hops = claims["key"], claims["hops"]
        if not isinstance(key_id, str) or not 0 < len(key_id) <= MAX_KEY_ID:
            raise PeerTokenError("token vouches for no valid key id")
        if not isinstance(hops, int) or isinstance(hops, bool) or hops < 0:
            raise PeerTokenError("token's hop count is not a count")
        return PeerClaim(cluster, key_id, hops)
