"""What a replica of this cluster requires: HTTPS with the cluster's replica certificate
and the cluster's replica token as a bearer (only its gateway and agent hold it).

The engine (`python -m engine.server`) and the simulated replica read the same
environment, which the process runtime sets (never argv: `ps` shows argv to everyone):
`FLEET_ENGINE_API_KEY`, `FLEET_ENGINE_SSL_CERTFILE`, `FLEET_ENGINE_SSL_KEYFILE`. A
Kubernetes replica gets the same variables from the cluster's replica Secret
(`replica_pod_env`): the certificate and key as files of a secret volume, the token
through a secretKeyRef, so no secret value is ever written into the pod object.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fleet_base.security.tls import Credentials

API_KEY_ENV = "FLEET_ENGINE_API_KEY"
CERT_ENV = "FLEET_ENGINE_SSL_CERTFILE"
KEY_ENV = "FLEET_ENGINE_SSL_KEYFILE"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the agent's probes and scrapes; no user data
# The replica Secret's keys: the file names of the enrolment bundle (`fleetctl clusters enroll`).
SECRET_CERT = "replica.pem"
SECRET_KEY = "replica.key"
SECRET_TOKEN = "replica-token"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def replica_env(creds: Credentials) -> dict[str, str]:
    """Environment for a replica process of this cluster (empty without credentials)."""
    if not creds.enabled or creds.replica_cert is None or creds.replica_key is None:
        return {}
    env = {CERT_ENV: str(creds.replica_cert), KEY_ENV: str(creds.replica_key)}
    if creds.replica_token:
        env[API_KEY_ENV] = creds.replica_token
    return env


def replica_pod_env(secret: str, mount_dir: str) -> list[dict]:
    """The container env of a replica pod: `replica_env`'s variables, the files from the
    `secret` volume mounted at `mount_dir`, the token by reference to `secret`."""
    return [
        {"name": CERT_ENV, "value": f"{mount_dir}/{SECRET_CERT}"},
        {"name": KEY_ENV, "value": f"{mount_dir}/{SECRET_KEY}"},
        {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": SECRET_TOKEN}}},
    ]


def replica_headers(creds: Credentials) -> dict[str, str]:
    """What the gateway sends a replica to be let in."""
    token = creds.replica_token if creds.enabled else None
    return {"authorization": f"Bearer {token}"} if token else {}


def require_bearer(app: ASGIApp, token: str | None) -> ASGIApp:
    """ASGI wrapper: 401 (OpenAI error shape) unless `Authorization: Bearer <token>`,
    except on OPEN_PATHS. `token` None: the app unchanged."""
    if not token:
        return app
    expected = f"Bearer {token}".encode()

    async def guarded(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await app(scope, receive, send)
            return
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(got, expected):
            await app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "This replica serves only its cluster's gateway",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return guarded
