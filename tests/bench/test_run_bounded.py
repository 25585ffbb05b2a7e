"""`bench.common.run_bounded`: the benches' request loop (bounded concurrency, a listed
failure is a None result, anything else ends the run)."""

from __future__ import annotations

import asyncio

import pytest

from bench.common import run_bounded


class Requests:
    """Requests that record how many are in flight; `fail` maps an index to what it raises."""

    def __init__(self, fail: dict[int, BaseException] | None = None) -> None:
        self.fail = fail or {}
        self.in_flight = 0
        self.most_in_flight = 0

    def make(self, i: int):
        async def request() -> int:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.01)
                if i in self.fail:
                    raise self.fail[i]
                return i * 10
            finally:
                self.in_flight -= 1

        return request


def test_at_most_concurrency_in_flight_and_results_in_order() -> None:
    reqs = Requests()
    ticks: list[int] = []
    results = asyncio.run(run_bounded([reqs.make(i) for i in range(7)], 3, (ValueError,), ticks.append))
    assert results == [i * 10 for i in range(7)]
    assert reqs.most_in_flight == 3 and reqs.in_flight == 0
    assert ticks == [1] * 7


def test_a_listed_error_is_a_none_result_and_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    reqs = Requests(fail={1: ValueError("refused: 429"), 4: KeyError("gone")})
    ticks: list[int] = []
    results = asyncio.run(
        run_bounded([reqs.make(i) for i in range(6)], 2, (ValueError, KeyError), ticks.append)
    )
    assert results == [0, None, 20, 30, None, 50]
    assert ticks == [1] * 6  # failed ones tick too: the bar reaches its total
    out = capsys.readouterr().out
    assert "request failed" in out and "refused: 429" in out


def test_an_unlisted_error_ends_the_run() -> None:
    reqs = Requests(fail={2: RuntimeError("a bug, not a refusal")})
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(run_bounded([reqs.make(i) for i in range(4)], 2, (ValueError,)))
