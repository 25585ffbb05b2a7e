"""A key the control plane marked `budget_exhausted` (its team's hard monthly budget is
spent) is refused with OpenAI's out-of-credit answer before any work, counted as a rate
limit with `limit="budget"`, and served again once the mark is gone."""

from __future__ import annotations

import httpx
import openai
import pytest

from fleet_base.api_keys import ApiKeyRecord
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, make_key, sample, scrape

BODY = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 1}


def test_a_key_whose_team_budget_is_spent_gets_429_insufficient_quota(
    east: GatewayProcess, keys: dict[str, tuple[str, ApiKeyRecord]]
) -> None:
    secret, record = make_key("budgeted")
    spent = record.model_copy(update={"team": "ml", "budget_exhausted": True})
    others = [r for _, r in keys.values()]
    east.write(keys=[*others, spent])
    before = sample(
        scrape(east.url), "fleet_gateway_rate_limited_total", deployment=DEPLOYMENT, limit="budget"
    )

    r = httpx.post(f"{east.url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "insufficient_quota" and err["code"] == "insufficient_quota"
    assert "monthly budget of team 'ml'" in err["message"]
    assert "retry-after" not in r.headers  # waiting does not help: the budget or the month must change
    after = sample(
        scrape(east.url), "fleet_gateway_rate_limited_total", deployment=DEPLOYMENT, limit="budget"
    )
    assert after == before + 1

    client = openai.OpenAI(base_url=f"{east.url}/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(
            model=DEPLOYMENT, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert caught.value.code == "insufficient_quota"

    east.write(keys=[*others, spent.model_copy(update={"budget_exhausted": False})])  # budget raised
    r = httpx.post(f"{east.url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 200, r.text
