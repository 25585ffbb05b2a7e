"""Per-key webhook secrets and Standard Webhooks signatures, verified with its library."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from fleet_base.batch.webhook_signing import (
    SECRET_PREFIX,
    encode_master,
    key_secret,
    new_master,
    read_master,
    signed_headers,
)


def test_a_signed_delivery_verifies_with_the_library() -> None:
    master = new_master()
    secret = key_secret(master, "a1b2c3", 0)
    payload = json.dumps({"id": "async_1", "status": "succeeded", "text": "é"}).encode()
    headers = signed_headers(secret, "async_1", payload, time.time())
    assert Webhook(secret).verify(payload, headers)["id"] == "async_1"
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(payload + b" ", headers)
    with pytest.raises(WebhookVerificationError):  # another key's secret
        Webhook(key_secret(master, "d4e5f6", 0)).verify(payload, headers)
    with pytest.raises(WebhookVerificationError):  # the secret before a rotation
        Webhook(key_secret(master, "a1b2c3", 1)).verify(payload, headers)


def test_secrets_differ_by_key_version_and_master() -> None:
    m1, m2 = new_master(), new_master()
    secrets = {key_secret(m, k, v) for m in (m1, m2) for k in ("k1", "k2") for v in (0, 1)}
    assert len(secrets) == 8
    assert all(s.startswith(SECRET_PREFIX) for s in secrets)
    assert key_secret(m1, "k1", 0) == key_secret(m1, "k1", 0)


def test_master_round_trip(tmp_path: Path) -> None:
    master = new_master()
    path = tmp_path / "webhook-master"
    path.write_bytes(encode_master(master))
    assert read_master(path) == master
    path.write_bytes(b"c2hvcnQ=\n")
    with pytest.raises(ValueError, match="32 bytes"):
        read_master(path)
