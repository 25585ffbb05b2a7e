"""Refusals at the gateway: 401/403 from the cluster's key set, and bad input answered in
OpenAI's shape without a byte reaching a replica."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from engine.server.process import ServerProcess
from fleet_base.api_keys import ApiKeyRecord
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, sample, scrape

BODY = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 1}
Keys = dict[str, tuple[str, ApiKeyRecord]]


def post(
    gw: GatewayProcess, body: object = BODY, headers: dict[str, str] | None = None, **kw: object
) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", json=body, headers=headers or {}, timeout=30, **kw)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_missing_or_bad_key_is_401(east: GatewayProcess, keys: Keys) -> None:
    main_secret = keys["main"][0]
    wrong_secret = main_secret[:-4] + ("AAAA" if not main_secret.endswith("AAAA") else "BBBB")
    cases = {
        "none": {},
        "not bearer": {"Authorization": main_secret},
        "empty bearer": {"Authorization": "Bearer"},
        "unknown id": bearer("fleet-nosuchkey-abcdef"),
        "not a fleet key": bearer("sk-whatever"),
        "wrong secret": bearer(wrong_secret),
        "revoked": bearer(keys["revoked"][0]),
    }
    for name, headers in cases.items():
        r = post(east, headers=headers)
        err = assert_openai_error(r, 401, "invalid_api_key")
        assert err["type"] == "authentication_error", name
    assert "revoked" in post(east, headers=cases["revoked"]).json()["error"]["message"]
    assert httpx.get(f"{east.url}/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{east.url}/v1", api_key="fleet-x-y", max_retries=0).models.list()


def test_key_scopes_and_deployments_are_403(east: GatewayProcess, keys: Keys) -> None:
    err = assert_openai_error(post(east, headers=bearer(keys["other"][0])), 403, "model_not_allowed")
    assert err["param"] == "model" and DEPLOYMENT in err["message"]
    assert_openai_error(post(east, headers=bearer(keys["readonly"][0])), 403, "insufficient_scope")
    # An admin key (the bootstrap token) manages the fleet and never runs inference.
    assert_openai_error(post(east, headers=bearer(keys["admin"][0])), 403, "insufficient_scope")
    # A key limited to another deployment does not see this one listed.
    listed = httpx.get(f"{east.url}/v1/models", headers=bearer(keys["other"][0]), timeout=10).json()
    assert listed["data"] == []


def test_revocation_takes_effect_within_a_second(east: GatewayProcess, keys: Keys) -> None:
    secret, record = keys["main"]
    assert post(east, headers=bearer(secret)).status_code == 200  # cached as verified now
    records = [r for _, r in keys.values() if r.key_id != record.key_id]
    east.files.write(keys=[*records, record.model_copy(update={"revoked": True})])
    revoked_at = time.monotonic()
    while post(east, headers=bearer(secret)).status_code != 401:
        assert time.monotonic() - revoked_at < 1.0, "revocation not applied within 1 s"
        time.sleep(0.02)


def _replica_traffic(replicas: list[ServerProcess]) -> tuple[int, float]:
    """(HTTP requests in the replicas' access logs, prompt tokens they processed)."""
    lines = sum(
        sum(1 for line in r.log_path.read_text(errors="replace").splitlines() if '"POST /v1/' in line)
        for r in replicas
        if r.log_path is not None
    )
    tokens = sum(
        sample(scrape(r.url), "fleet_engine_prompt_tokens_total", model=DEPLOYMENT) for r in replicas
    )
    return lines, tokens


BAD_INPUTS: list[tuple[str, str, object, int, str | None]] = [
    # (name, path, body (bytes: raw), status, param)
    ("not json", "/v1/completions", b"{not json", 400, None),
    ("json array", "/v1/completions", b"[1, 2]", 400, None),
    ("no model", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("model not a string", "/v1/completions", {"model": 3, "prompt": "hi"}, 400, "model"),
    ("empty model", "/v1/chat/completions", {"model": " ", "messages": []}, 400, "model"),
    ("unknown deployment", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("messages not a list", "/v1/chat/completions", {"model": DEPLOYMENT, "messages": "hi"}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", {"model": DEPLOYMENT, "messages": []}, 400, "messages"),
    ("message not an object", "/v1/chat/completions", {"model": DEPLOYMENT, "messages": ["hi"]}, 400, "messages"),
    ("no prompt", "/v1/completions", {"model": DEPLOYMENT}, 400, "prompt"),
    ("prompt a number", "/v1/completions", {"model": DEPLOYMENT, "prompt": 5}, 400, "prompt"),
    ("prompt mixed list", "/v1/completions", {"model": DEPLOYMENT, "prompt": ["a", 1]}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"model": DEPLOYMENT, "prompt": [[]]}, 400, "prompt"),
    ("stream not bool", "/v1/completions", {"model": DEPLOYMENT, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("max_tokens a string", "/v1/completions", {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": "9"}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens bool", "/v1/chat/completions", {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, 400, "max_tokens"),
    ("stream_options not object", "/v1/completions", {"model": DEPLOYMENT, "prompt": "hi", "stream": True, "stream_options": 1}, 400, "stream_options"),
    ("body too large", "/v1/completions", {"model": DEPLOYMENT, "prompt": "x" * 70_000}, 413, None),
]  # fmt: skip


def test_bad_input_never_reaches_a_replica(
    east: GatewayProcess, secret: str, replicas: list[ServerProcess]
) -> None:
    before = _replica_traffic(replicas)
    with httpx.Client(base_url=east.url, headers=bearer(secret), timeout=30) as h:
        for name, path, body, status, param in BAD_INPUTS:
            if isinstance(body, bytes):
                r = h.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(path, json=body)
            err = assert_openai_error(r, status)
            assert err["param"] == param, (name, err)
            assert err["type"] == "invalid_request_error", name
        assert_openai_error(h.get("/v1/nothing-here"), 404)
        assert_openai_error(h.get("/v1/completions"), 405)
    assert _replica_traffic(replicas) == before


def test_replica_validation_passes_through_unchanged(
    east: GatewayProcess, secret: str, replicas: list[ServerProcess]
) -> None:
    """What only the engine checks (here: temperature's range) comes back exactly as the engine says it."""
    body = {"model": DEPLOYMENT, "prompt": "hi", "temperature": 7}
    direct = httpx.post(f"{replicas[0].url}/v1/completions", json=body, timeout=30)
    via = post(east, body, headers=bearer(secret))
    assert direct.status_code == 400
    assert via.status_code == direct.status_code and via.json() == direct.json()
