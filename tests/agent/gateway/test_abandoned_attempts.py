"""A non-streamed generation that outlasts the gateway's per-attempt deadline, through a
real gateway process in front of the two real tiny-Llama replicas: the gateway gives up on
each attempt, the replica stops generating it (its engine counts an abort), and the key is
charged for every attempt that was sent, not nothing."""

from __future__ import annotations

from pathlib import Path

import httpx

from engine.server.process import ServerProcess
from fleet_base.api_keys import Quotas
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import (
    DEPLOYMENT,
    GatewayProcess,
    make_key,
    peer,
    replica,
    route,
    sample,
    scrape,
)
from tests.polling import wait_for

BUDGET = 1000
PROMPT = list(range(1, 9))  # token ids: the gateway and the engine count the same 8 tokens


def test_a_generation_abandoned_at_its_deadline_is_charged_and_stopped(
    tmp_path: Path, nats, replicas: list[ServerProcess]
) -> None:
    secret, record = make_key("slow")
    record = record.model_copy(update={"quotas": Quotas(tokens_per_minute=BUDGET)})
    gw = GatewayProcess(
        tmp_path / "gw",
        "east",
        nats_url=nats.url,
        first_byte_timeout_s=0.2,
        token_timeout_s=0.0,
        quota_minute_s=86400.0,  # no refill to speak of while the test runs
    )

    def engine_counts() -> dict[str, float]:
        """Over both replicas: API requests that reached an engine, and finishes by reason."""
        out = dict.fromkeys(("admitted", "abort", "length", "stop"), 0.0)
        for r in replicas:
            samples = scrape(r.url)
            out["admitted"] += sum(
                v for (name, _), v in samples.items() if name == "fleet_engine_api_requests_total"
            )
            for reason in ("abort", "length", "stop"):
                out[reason] += sample(
                    samples, "fleet_engine_requests_total", model=DEPLOYMENT, finish_reason=reason
                )
        return out

    gw.start()
    try:
        gw.write(
            replicas=[replica("r1", replicas[0].url), replica("r2", replicas[1].url)],
            keys=[record],
            routes=[route(DEPLOYMENT, [peer("east", gw.url, *EAST)])],
        )
        headers = {"Authorization": f"Bearer {secret}"}
        before = engine_counts()
        body = {"model": DEPLOYMENT, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
        # The engines are frozen while the request runs, so each attempt outlasts its deadline
        # however fast the machine (the tiny model can write 240 tokens in under 0.2 s).
        try:
            for rep in replicas:
                assert httpx.post(f"{rep.url}/debug/freeze", timeout=10).status_code == 200
            r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=headers, timeout=30)
        finally:
            for rep in replicas:
                httpx.post(f"{rep.url}/debug/thaw", timeout=10)
        assert r.status_code == 502, r.text  # both replicas timed out: no third try

        # Each attempt sent is charged its prompt (no usage came back from either).
        probe = httpx.post(
            f"{gw.url}/v1/completions", json={**body, "model": "nope"}, headers=headers, timeout=10
        )
        assert probe.status_code == 404
        assert int(probe.headers["x-ratelimit-remaining-tokens"]) == BUDGET - 2 * len(PROMPT)

        # A timed-out attempt may have run: one retry after it, not two.
        metrics = scrape(gw.url)
        timeouts = sample(
            metrics, "fleet_gateway_upstream_errors_total", deployment=DEPLOYMENT, reason="timeout"
        )
        assert timeouts == 2
        charged = sample(
            metrics, "fleet_gateway_abandoned_tokens_charged_total", deployment=DEPLOYMENT, reason="timeout"
        )
        assert charged == 2 * len(PROMPT)

        # Every attempt that reached an engine ended there, aborted: none ran to its end.
        def ended() -> dict[str, float] | None:
            now = {k: v - before[k] for k, v in engine_counts().items()}
            return now if now["abort"] + now["length"] + now["stop"] >= now["admitted"] else None

        spent = wait_for(ended, 30, "the abandoned attempts to end on the replicas", 0.1)
        assert spent["admitted"] >= 1 and spent["abort"] == spent["admitted"], spent
        assert spent["length"] == spent["stop"] == 0, spent
    finally:
        gw.stop()
