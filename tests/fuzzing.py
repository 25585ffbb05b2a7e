"""Drive schemathesis (a property-based API fuzzer) from a server's own OpenAPI document:
every operation, valid-looking (positive) and schema-breaking (negative) inputs, a bounded
number of examples each. Returns the 5xx answers (and transport failures) it saw, so a
test can assert there are none; the server's health is the caller's to check after.

Driven through `APIOperation.as_strategy` and hypothesis directly (not schemathesis's
pytest plugin) so a live server started by a fixture can be the target."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


@dataclass
class FuzzReport:
    calls: int = 0
    call_s: float = 0.0  # of the wall time, waiting for the server
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def table(self) -> str:
        return ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))


def fuzz(
    schema_url: str,
    base_url: str,
    *,
    headers: dict[str, str] | None = None,
    examples: int = 10,
    skip: tuple[str, ...] = (),
    timeout: float = 60.0,
    pin: dict[str, object] | None = None,
) -> FuzzReport:
    """`pin`: fields set in every positive JSON body (say the served model's name), so
    valid-looking requests get past the first check and exercise the rest."""
    schema = schemathesis.openapi.from_url(schema_url)
    report = FuzzReport()
    for result in schema.get_all_operations():
        op = result.ok()
        if f"{op.method.upper()} {op.path}" in skip:
            continue
        for mode in MODES:
            positive = mode is schemathesis.GenerationMode.POSITIVE

            def call(case, label: str = mode.value, positive: bool = positive) -> None:
                report.calls += 1
                if pin and positive and isinstance(case.body, dict):
                    case.body.update(pin)
                began = time.perf_counter()
                try:
                    response = case.call(base_url=base_url, headers=headers, timeout=timeout)
                    report.call_s += time.perf_counter() - began
                except requests.RequestException as err:
                    report.failures.append(
                        f"{case.method} {case.formatted_path}: {type(err).__name__}: {err}"
                    )
                    report.statuses["error"] += 1
                    return
                report.statuses[response.status_code] += 1
                if response.status_code >= 500:
                    body = case.body if not isinstance(case.body, bytes) else case.body[:300]
                    report.failures.append(
                        f"{case.method} {case.formatted_path} {label} body={str(body)[:300]} "
                        f"query={case.query} -> {response.status_code}: {response.text[:300]}"
                    )

            run = settings(
                max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )(given(case=op.as_strategy(generation_mode=mode))(_test_of(call)))
            try:
                run()
            except Unsatisfiable:  # nothing to break (a GET without parameters, negatively)
                continue
    return report


def _test_of(call):
    """A one-argument function for @given (which refuses defaults) calling `call`."""

    def run(case) -> None:
        call(case)

    return run
