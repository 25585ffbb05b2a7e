"""A RAG pipeline on real processes (nats-server, control plane, two clusters in two
regions, each an agent and its gateway with real engine replicas of SmolLM2-135M): an
embeddings deployment and a chat deployment, one replica of each per cluster, grouped by
`fleetctl pipeline create rag`. A client embeds a small corpus once, then for each question
embeds it (the pipeline's first hop), retrieves the closest passages by cosine similarity
and asks the chat model with them (the second hop, same pipeline request), through its
own cluster's gateway.

What must hold (docs/pipelines.md, "Routing"): every hop of a pipeline request is served
in one cluster, the client's while every step is ready there, as the client sees it
(`x-fleet-cluster`) and as the stored usage records say (`GET /v1/pipelines/rag/requests`:
each hop's step, deployment and cluster, grouped by `pipeline_request`); with the
chat replica of one cluster killed, new pipeline requests through that cluster's gateway
are served whole by the other cluster, never split; no client request fails except hops
refused with the documented 503 while the gateway learns of the loss (counted, and the
client restarts the pipeline request). Prints the per-step hop latency (client-timed, and
the gateways' `fleet_pipeline_step_seconds`).

Real engines for both steps: the sim runtime serves no embeddings, and a cluster runs one
runtime. Four SmolLM2 processes (one thread each) on the 2-core box: the cold start is
most of the test's time."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.sim_fleet import SimFleet, kill_trees, wait_for
from tests.fleetctl import fleetctl_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EAST, WEST = "local-east", "local-west"
PIPELINE, EMBED, ANSWER = "rag", "embedder", "chat"
PER_CLUSTER = 4  # pipeline requests from each cluster's gateway while both are whole
AFTER_KILL = 4  # new pipeline requests through the degraded cluster's gateway
MAX_TOKENS = 12
CORPUS = [
    "Fleet places every step of a pipeline in the same clusters.",
    "A pipeline request runs whole in one cluster; its hops never cross regions.",
    "Each step scales on its own demand, within the end-to-end budget.",
    "The gateway refuses a later hop with 503 when its step is gone from the cluster.",
    "Paris is the capital of France and sits on the river Seine.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "The Pacific is the largest and deepest of the oceans.",
    "A violin has four strings tuned in perfect fifths.",
]
QUESTIONS = [
    "Where do a pipeline's hops run?",
    "What is the capital of France?",
    "How does a plant make sugar?",
    "Which ocean is the deepest?",
    "How many strings does a violin have?",
    "How does each step scale?",
]


@dataclass
class Hop:
    step: str
    status: int
    cluster: str  # x-fleet-cluster: where it was served
    seconds: float


@dataclass
class Run:
    """One pipeline request as the client saw it: its attempts' hops, the id of the one served."""

    gateway: str  # the region whose gateway the client used
    question: str
    hops: list[Hop] = field(default_factory=list)
    request_id: str = ""
    refused: int = 0  # hops refused with 503 (the client restarted the pipeline request)
    answer: str = ""
    passages: list[int] = field(default_factory=list)

    @property
    def served(self) -> list[Hop]:
        return [h for h in self.hops if h.status == 200][-2:]


def stored_requests(fleet: SimFleet) -> dict[str, list[dict]]:
    """request id -> its hops (step, deployment, cluster, status) from the control plane's
    stored usage records (`GET /v1/pipelines/rag/requests`)."""
    r = fleet.api("GET", f"/v1/pipelines/{PIPELINE}/requests", params={"since": "1h"})
    assert r.status_code == 200, r.text
    return {item["request"]: item["hops"] for item in r.json()["items"]}


def wait_stored(fleet: SimFleet, ids: set[str], timeout: float = 30) -> dict[str, list[dict]]:
    """The stored requests once every one of `ids` has its two served hops there."""

    def complete():
        got = stored_requests(fleet)
        return all(sum(h["status"] == 200 for h in got.get(i, [])) >= 2 for i in ids) and got

    return wait_for(complete, timeout, 0.5, "the stored usage records of every pipeline request")


def served_hops(hops: list[dict]) -> set[tuple[str, str, str]]:
    return {(h["step"], h["deployment"], h["cluster"]) for h in hops if h["status"] == 200}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[SimFleet]:
    home = tmp_path_factory.mktemp("pipeline")
    fleet = SimFleet(
        home,
        [EAST, WEST],
        slots=2,  # one embedder and one chat replica per cluster
        runtime="process",
        replica_args=["--threads", "1", "--max-model-len", "512", "--log-level", "warning"],
    )
    try:
        fleet.up()
        for name in (EMBED, ANSWER):  # one replica in each region
            r = fleet.api(
                "POST", "/v1/deployments", json={"name": name, "model": "smollm2-135m", "replicas": 2,
                                                 "min_regions": 2},
            )  # fmt: skip
            assert r.status_code == 201, r.text
        yield fleet
    finally:
        fleet.down()


def post(gateway: str, key: str, path: str, body: dict, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{gateway}{path}", json=body, headers={"authorization": f"Bearer {key}", **headers}, timeout=120
    )


def embed(gateway: str, key: str, texts: list[str], headers: dict[str, str]) -> tuple[httpx.Response, list]:
    body = {"model": EMBED, "input": texts, "encoding_format": "float"}
    r = post(gateway, key, "/v1/embeddings", body, headers)
    vectors = [d["embedding"] for d in r.json()["data"]] if r.status_code == 200 else []
    return r, vectors


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))


def ask(fleet: SimFleet, region: str, question: str, corpus: list[list[float]], attempts: int = 8) -> Run:
    """One pipeline request through `region`'s gateway, restarted whole (no id) after a 503."""
    gateway, run = fleet.gateways[region], Run(region, question)
    for _ in range(attempts):
        headers = {"X-Fleet-Pipeline": PIPELINE, "X-Fleet-Pipeline-Step": "embed"}
        started = time.monotonic()
        r, vectors = embed(gateway, fleet.key, [question], headers)
        run.hops.append(
            Hop("embed", r.status_code, r.headers.get("x-fleet-cluster", ""), time.monotonic() - started)
        )
        if r.status_code == 503:
            run.refused += 1
            time.sleep(0.5)
            continue
        assert r.status_code == 200, r.text
        request_id = r.headers["x-fleet-pipeline-request"]
        run.passages = sorted(range(len(CORPUS)), key=lambda i: -cosine(vectors[0], corpus[i]))[:2]
        context = "\n".join(CORPUS[i] for i in run.passages)
        body = {
            "model": ANSWER,
            "messages": [
                {"role": "system", "content": f"Answer from this context:\n{context}"},
                {"role": "user", "content": question},
            ],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        headers = {**headers, "X-Fleet-Pipeline-Step": "answer", "X-Fleet-Pipeline-Request": request_id}
        started = time.monotonic()
        r = post(gateway, fleet.key, "/v1/chat/completions", body, headers)
        run.hops.append(
            Hop("answer", r.status_code, r.headers.get("x-fleet-cluster", ""), time.monotonic() - started)
        )
        if r.status_code == 503:
            run.refused += 1
            time.sleep(0.5)
            continue
        assert r.status_code == 200, r.text
        run.request_id = request_id
        run.answer = r.json()["choices"][0]["message"]["content"]
        return run
    raise AssertionError(f"pipeline request through {region} not served in {attempts} attempts: {run.hops}")


def pipeline_status(fleet: SimFleet) -> dict[str, bool]:
    row = fleet.api("GET", f"/v1/pipelines/{PIPELINE}").json()
    return {c["cluster"]: c["ready"] for c in row["clusters"]}


def replica_pids(fleet: SimFleet, deployment: str, cluster: str) -> list[int]:
    ids = {p["replica_id"] for p in fleet.deployment(deployment)["placements"] if p["cluster"] == cluster}
    state = fleet.local.load()
    assert state is not None
    return [rec.pid for rec in fleet.local.replicas(state) if rec.name in {f"{cluster}/{i}" for i in ids}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gateway_histogram(fleet: SimFleet, region: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(step, cluster) -> (count, sum) of `fleet_pipeline_step_seconds` on the region's gateway."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for step in ("embed", "answer"):
        for cluster in (EAST, WEST):
            labels = {"pipeline": PIPELINE, "step": step, "cluster": cluster}
            count = fleet.gateway_metric(region, "fleet_pipeline_step_seconds_count", **labels)
            total = fleet.gateway_metric(region, "fleet_pipeline_step_seconds_sum", **labels)
            if count:
                out[(step, cluster)] = (count, total)
    return out


def served_in(run: Run) -> list[tuple[str, str]]:
    """(step, cluster) of the hops that served the pipeline request, as the client saw them."""
    return [(h.step, h.cluster) for h in run.served]


def serve_from_both(fleet: SimFleet, corpus: list[list[float]]) -> list[Run]:
    """PER_CLUSTER pipeline requests through each gateway: every hop in the client's cluster."""
    for region in (EAST, WEST):  # each gateway serves locally once its routes carry the pipeline
        wait_for(
            lambda region=region: {c for _, c in served_in(ask(fleet, region, QUESTIONS[0], corpus))} == {region},
            60, 0.5, f"{region}'s gateway to serve the pipeline locally",
        )  # fmt: skip
    runs = [
        ask(fleet, region, QUESTIONS[i % len(QUESTIONS)], corpus)
        for i in range(PER_CLUSTER)
        for region in (EAST, WEST)
    ]
    for run in runs:
        assert served_in(run) == [("embed", run.gateway), ("answer", run.gateway)], run.hops
        assert run.refused == 0 and run.request_id, run
        if "capital" in run.question:  # retrieval works: the Paris passage is found
            assert 4 in run.passages, run.passages
    stored = wait_stored(fleet, {run.request_id for run in runs})
    for run in runs:  # the stored usage records say so too: each hop's step, deployment and cluster
        want = {("embed", EMBED, run.gateway), ("answer", ANSWER, run.gateway)}
        assert served_hops(stored[run.request_id]) == want, stored[run.request_id]
    return runs


def fail_over(fleet: SimFleet, corpus: list[list[float]]) -> tuple[list[Run], list[Run], float]:
    """Kill east's chat replica; new pipeline requests through east's gateway: those until
    the first is served whole in west (the switch), then up to AFTER_KILL more while east's
    chat is still down. Returns (switch, moved, seconds from the kill to the first in west)."""
    pids = replica_pids(fleet, ANSWER, EAST)
    assert len(pids) == 1, pids
    killed_at = time.monotonic()
    kill_trees(pids)
    switch: list[Run] = []  # not in a wait_for: a client failure must fail the test, not retry
    while not switch or {c for _, c in served_in(switch[-1])} != {WEST}:
        assert time.monotonic() - killed_at < 60, f"no request through east served in west: {switch}"
        switch.append(ask(fleet, EAST, QUESTIONS[len(switch) % len(QUESTIONS)], corpus))
    switch_s = time.monotonic() - killed_at
    # the control plane has seen the loss (east not ready) before the requests that must go west
    wait_for(lambda: not pipeline_status(fleet)[EAST], 30, 0.2, "east's pipeline to be reported not ready")
    moved: list[Run] = []
    while len(moved) < AFTER_KILL and not pipeline_status(fleet)[EAST]:
        run = ask(fleet, EAST, QUESTIONS[len(moved) % len(QUESTIONS)], corpus)
        if pipeline_status(fleet)[EAST]:
            break  # east's chat is back: this one may rightly have been served in east
        moved.append(run)
    assert len(moved) >= 2, f"east's chat came back before new requests were sent: {len(moved)}"
    for run in moved:  # served whole in west, as the client saw it, nothing refused
        assert served_in(run) == [("embed", WEST), ("answer", WEST)], run.hops
        assert run.refused == 0, run.hops
    stored = wait_stored(fleet, {run.request_id for run in [*switch, *moved]})
    for run in moved:  # and as the stored usage records say
        assert served_hops(stored[run.request_id]) == {("embed", EMBED, WEST), ("answer", ANSWER, WEST)}
    return switch, moved, switch_s


def print_latency(fleet: SimFleet, runs: list[Run]) -> None:
    """p50/p90 of each step's hop per serving cluster as the client timed it, beside the
    gateways' `fleet_pipeline_step_seconds` (mean over every hop they served, warm-ups too)."""
    print(
        "\n step   | cluster    | hops | client p50 s | client p90 s | gateway fleet_pipeline_step_seconds mean s"
    )
    histograms = [gateway_histogram(fleet, region) for region in (EAST, WEST)]
    for step in ("embed", "answer"):
        for cluster in (EAST, WEST):
            seconds = [
                h.seconds for run in runs for h in run.served if (h.step, h.cluster) == (step, cluster)
            ]
            count = sum(h.get((step, cluster), (0, 0))[0] for h in histograms)
            total = sum(h.get((step, cluster), (0, 0))[1] for h in histograms)
            mean = f"{total / count:.3f} ({count:.0f} hops)" if count else "-"
            if seconds:
                print(f" {step:<6} | {cluster:<10} | {len(seconds):>4} | {percentile(seconds, 0.5):>12.3f} | "
                      f"{percentile(seconds, 0.9):>12.3f} | {mean}")  # fmt: skip


def test_rag_pipeline_stays_in_a_cluster_and_fails_over_whole(fleet: SimFleet) -> None:
    t0 = time.monotonic()
    created = fleetctl_json(
        fleet.home, "pipeline", "create", PIPELINE, "--step", f"embed={EMBED}", "--step", f"answer={ANSWER}"
    )
    assert [s["deployment"] for s in created["steps"]] == [EMBED, ANSWER], created
    wait_for(lambda: pipeline_status(fleet) == {EAST: True, WEST: True}, 300, 1.0, "every step ready in both")
    ready_s = time.monotonic() - t0

    r, corpus = embed(fleet.gateways[EAST], fleet.key, CORPUS, {})  # once: plain deployment traffic
    assert r.status_code == 200 and len(corpus) == len(CORPUS), r.text
    local = serve_from_both(fleet, corpus)
    switch, moved, switch_s = fail_over(fleet, corpus)
    row = fleet.api("GET", f"/v1/pipelines/{PIPELINE}/requests", params={"since": "1h"}).json()
    assert row["split"] == 0, [i for i in row["items"] if i["split"]]  # no pipeline request ever split

    # the gateways count what they did with each pipeline request: east sent the moved ones whole to west
    outcomes = {
        (region, outcome): fleet.gateway_metric(
            region, "fleet_pipeline_requests_total", pipeline=PIPELINE, cluster=region, outcome=outcome
        )
        for region in (EAST, WEST)
        for outcome in ("local", "forwarded")
    }
    assert outcomes[(EAST, "forwarded")] >= len(moved) and outcomes[(WEST, "local")] >= len(moved), outcomes
    assert outcomes[(EAST, "local")] >= 1, outcomes

    runs = [*local, *switch, *moved]
    refused = {
        step: sum(h.status == 503 and h.step == step for run in runs for h in run.hops)
        for step in ("embed", "answer")
    }
    print(
        f"\n[pipeline] every step ready in both clusters {ready_s:.0f} s after create; {len(local)} pipeline "
        f"requests served whole in the client's cluster; {EAST}'s chat killed: the first new request through "
        f"{EAST} served whole in {WEST} {switch_s:.1f} s later ({len(switch)} tried; hops refused with the "
        f"documented 503 and restarted: {refused}), then {len(moved)} more whole in {WEST}; "
        f"{row['requests']} pipeline requests in the stored usage records ({row['by_cluster']}), 0 split; 0 client failures"
    )
    print(
        f"[pipeline] a sample answer: {local[2].question!r} -> {local[2].answer!r} (passages {local[2].passages})"
    )
    print_latency(fleet, runs)
