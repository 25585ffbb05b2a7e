"""Signing webhook deliveries per the Standard Webhooks specification, with a secret per
API key that nobody stores.

The fleet holds one webhook master secret (32 random bytes, 0600, created by `fleetctl up` /
cluster enrolment beside the cluster's other credentials). A key's signing secret is derived
from it, `whsec_` + base64(HMAC-SHA256(master, "<key_id>:<version>")), so every gateway of
every cluster signs with the same secret without it ever being written anywhere, and the
control plane can show it once (on key creation, and on rotation, which raises the
version carried in the key's `ApiKeyRecord`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path

from standardwebhooks import Webhook

MASTER_BYTES = 32
MASTER_FILE = "webhook-master"  # its name in the fleet's pki directory and in a cluster bundle
MASTER_ENV = "FLEET_WEBHOOK_MASTER"  # a process's path to it when no credential bundle names it
SECRET_PREFIX = "whsec_"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"


class NoMasterSecret(Exception):
    """This process was given no webhook master secret: it cannot sign or show secrets."""


def new_master() -> bytes:
    return secrets.token_bytes(MASTER_BYTES)


def encode_master(master: bytes) -> bytes:
    return base64.b64encode(master) + b"\n"


def read_master(path: Path) -> bytes:
    """The master secret stored at `path` (base64, one line)."""
    master = base64.b64decode(path.read_bytes().strip(), validate=True)
    if len(master) < MASTER_BYTES:
        raise ValueError(f"{path}: a webhook master secret has {MASTER_BYTES} bytes, this has {len(master)}")
    return master


def master_path(configured: Path | None) -> Path | None:
    """Where this process finds the master secret: its credential bundle's file, else
    FLEET_WEBHOOK_MASTER; None when neither is set."""
    if configured is not None:
        return configured
    env = os.environ.get(MASTER_ENV)
    return Path(env).expanduser() if env else None


def key_secret(master: bytes, key_id: str, version: int = 0) -> str:
    """The signing secret of `key_id` at `version` (what its owner verifies with)."""
    digest = hmac.new(master, f"{key_id}:{version}".encode(), hashlib.sha256).digest()
    return SECRET_PREFIX + base64.b64encode(digest).decode()


def signed_headers(secret: str, msg_id: str, payload: bytes, at: float) -> dict[str, str]:
    """The Standard Webhooks headers of one delivery attempt of `payload`. The id is the
    same on every attempt (receivers de-duplicate on it); the timestamp is the attempt's."""
    when = datetime.fromtimestamp(at, tz=timezone.utc)
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(int(at)),
        SIGNATURE_HEADER: Webhook(secret).sign(msg_id, when, payload),
    }
