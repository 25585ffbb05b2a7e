"""A non-streamed answer's time to first token: the replica's `x-fleet-ttft-s` plus this
gateway's time before the call, taken only when it is a finite number the attempt can have
taken (a replica's header is data); the contract's own writer and reader."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from agent.gateway.proxy import Opened
from fleet_base.openai_contract.timing import TTFT_HEADER, read_ttft, ttft_header


async def _nothing():  # the rest of a body already read
    return
    yield b""


def opened(header: str | None, *, sent_ago: float) -> Opened:
    headers = {} if header is None else {TTFT_HEADER: header}
    response = httpx.Response(200, headers=headers, content=b"{}")
    return Opened(response, b"{}", _nothing(), sent_at=time.monotonic() - sent_ago)


def test_the_replicas_figure_plus_the_time_before_the_call() -> None:
    now = time.monotonic()
    got = opened("0.25", sent_ago=1.0).first_token_s(since=now - 3.0)  # sent 2 s after arrival
    assert got == pytest.approx(2.25, abs=0.05)


@pytest.mark.parametrize(
    "header",
    [None, "", "nan", "NaN", "inf", "-inf", "-0.5", "1.5", "1e9", "abc", "0x10", "1" * 40, "true"],
)
def test_a_bogus_or_impossible_figure_is_ignored(header: str | None) -> None:
    """Missing, not a number, not finite, negative, or more than the attempt's 1 s."""
    assert opened(header, sent_ago=1.0).first_token_s(since=time.monotonic() - 1.0) is None


@pytest.mark.parametrize(
    ("value", "at_most", "expected"),
    [("0", 1.0, 0.0), ("1.0", 1.0, 1.0), (" 0.5 ", 1.0, 0.5), ("1.0000001", 1.0, None), ("-0", 1.0, 0.0)],
)
def test_read_ttft_bounds(value: str, at_most: float, expected: float | None) -> None:
    assert read_ttft(value, at_most) == expected


@pytest.mark.parametrize("seconds", [None, math.nan, math.inf, -1.0])
def test_nothing_to_say_writes_no_header(seconds: float | None) -> None:
    assert ttft_header(seconds) == {}


def test_the_written_header_reads_back() -> None:
    (value,) = ttft_header(0.1234567).values()
    assert value == "0.123457" and read_ttft(value, 1.0) == pytest.approx(0.123457)
