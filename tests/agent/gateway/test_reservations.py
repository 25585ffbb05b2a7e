"""Quota reservations for the real worst case: a chat request without max_tokens, or a
Responses request without max_output_tokens, reserves the context it may fill (up to the
key's budget here, so it is never refused outright), a settlement charges what the engine
reports plus the prompt of every attempt abandoned after it was sent, and a stream cut
short is charged for the tokens it carried."""

from __future__ import annotations

import json

from agent.gateway.errors import GatewayError
from agent.gateway.exchange import Call, Exchange, Settlement
from agent.gateway.inputs import parse_request
from agent.gateway.limits import QuotaGate
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.plan import Attempt
from agent.gateway.sse import StreamObserver
from fleet_base.api_keys import Quotas
from tests.agent.gateway.harness import make_key

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}]}


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def gate() -> tuple[QuotaGate, Clock]:
    clock = Clock()
    return QuotaGate("east", GatewayMetrics(), minute_s=60.0, clock=clock), clock


def keyed(tpm: int):
    _, record = make_key("k")
    return record.model_copy(update={"quotas": Quotas(tokens_per_minute=tpm)})


def test_worst_case_is_max_tokens_else_the_context_left() -> None:
    given = parse_request(json.dumps({**CHAT, "max_tokens": 7, "n": 2}).encode(), "chat")
    assert given.worst_case_tokens(4096) == given.prompt_tokens + 14
    open_ended = parse_request(json.dumps({**CHAT, "n": 2}).encode(), "chat")
    assert not open_ended.max_tokens_given
    assert (
        open_ended.worst_case_tokens(4096) == open_ended.prompt_tokens + (4096 - open_ended.prompt_tokens) * 2
    )
    completion = parse_request(json.dumps({"model": "m", "prompt": "hi"}).encode(), "completions")
    assert completion.worst_case_tokens(4096) == completion.cost_tokens  # the engine's default of 16


def test_open_ended_request_reserves_up_to_the_budget_and_settles_to_usage() -> None:
    quota, _ = gate()
    key = keyed(10_000)
    info = parse_request(json.dumps(CHAT).encode(), "chat")
    reservation, headers = quota.admit(key, info, info.worst_case_tokens(4096))
    assert reservation is not None and reservation.tokens == 4096  # not the old 256
    assert int(headers["x-ratelimit-remaining-tokens"]) == 10_000 - 4096
    quota.settle(reservation, {"prompt_tokens": 14, "completion_tokens": 30}, ran=True)
    assert int(quota.headers(key, "m")["x-ratelimit-remaining-tokens"]) == 10_000 - 44

    small = keyed(1000)  # a context bigger than the whole budget: reserve the budget, admit
    reservation, _ = quota.admit(small, info, info.worst_case_tokens(4096))
    assert reservation is not None and reservation.tokens == 1000


def test_a_cut_stream_counts_the_tokens_it_carried() -> None:
    observer = StreamObserver(strip_usage=True)
    for text in ("Hel", "lo", ""):
        chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        observer.observe(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    two = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}
    observer.observe(b"data: " + json.dumps(two).encode() + b"\n\n")
    assert observer.tokens_seen == 4 and observer.usage is None and observer.first_token


def test_every_endpoint_without_a_limit_reserves_what_the_engine_may_generate() -> None:
    """Responses without max_output_tokens runs to the end of the context on the engine, as
    chat without max_tokens does; n multiplies; completions' bound is the contract's
    default (16, also for an explicit null), as the replica applies it."""
    responses = parse_request(json.dumps({"model": "m", "input": "x" * 40}).encode(), "responses")
    assert not responses.max_tokens_given
    assert responses.worst_case_tokens(4096) == 4096
    chat = parse_request(json.dumps({**CHAT, "n": 3}).encode(), "chat")
    assert chat.worst_case_tokens(4096) == chat.prompt_tokens + (4096 - chat.prompt_tokens) * 3
    nulled = {"model": "m", "prompt": ["x" * 40, "y"], "max_tokens": None, "n": 3}
    completion = parse_request(json.dumps(nulled).encode(), "completions")
    assert completion.worst_case_tokens(4096) == completion.prompt_tokens + 16 * 2 * 3


def test_an_open_ended_responses_request_that_would_overdraw_is_refused() -> None:
    quota, _ = gate()
    key = keyed(10_000)
    info = parse_request(json.dumps({"model": "m", "input": "hi"}).encode(), "responses")
    reservation, _ = quota.admit(key, info, info.worst_case_tokens(4096))
    assert reservation is not None and reservation.tokens == 4096  # not prompt + 256
    quota.admit(key, info, info.worst_case_tokens(4096))
    try:  # 10,000 - 2 x 4096 left: a third open-ended request would overdraw
        quota.admit(key, info, info.worst_case_tokens(4096))
    except GatewayError as err:
        assert err.status == 429
    else:
        raise AssertionError("a third open-ended request was admitted past the budget")


def test_abandoned_attempts_are_charged_on_top_of_the_answer_once() -> None:
    """An attempt given up after it was sent costs its prompt, whatever answered in the end;
    a peer's attempt is charged by the peer; the settlement still happens once."""
    quota, _ = gate()
    key = keyed(10_000)
    info = parse_request(json.dumps({**CHAT, "max_tokens": 10}).encode(), "chat")
    here = Attempt("local", "least-load", "r1", "http://r1")
    peer = Attempt("failover", "failover", "west", "http://west", is_peer=True)

    def exchange() -> Exchange:
        reservation, _ = quota.admit(key, info)
        return Exchange(Call("req", "k", info, 0.0), Settlement(quota, reservation))

    answered = exchange()
    assert answered.abandoned(here) == info.prompt_tokens and answered.abandoned(peer) == 0
    answered.settlement.settle({"prompt_tokens": 14, "completion_tokens": 3}, ran=True)
    answered.settlement.settle({"prompt_tokens": 14, "completion_tokens": 3}, ran=True)
    spent = 14 + 3 + info.prompt_tokens
    assert int(quota.headers(key, "m")["x-ratelimit-remaining-tokens"]) == 10_000 - spent

    failed_over = exchange()  # timed out here, then a peer's answer was taken
    failed_over.abandoned(here)
    failed_over.took(peer, 200)
    spent += info.prompt_tokens
    assert int(quota.headers(key, "m")["x-ratelimit-remaining-tokens"]) == 10_000 - spent
