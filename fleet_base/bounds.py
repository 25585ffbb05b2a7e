"""Bounds on untrusted input, shared by every edge (engine server, gateway, control plane).

Torch-free and dependency-light, so the gateway and the control plane import it without
loading the engine. One home for "how big may this be": integer ranges (a seed fits the
int64 a torch generator takes, token counts stay far below what would overflow a float
sum), finite floats, and a JSON reader that bounds nesting depth and refuses lone
surrogates (which decode in Python but cannot be re-encoded as UTF-8) before any work.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# A request's seed; sequence j of an n-sequence request uses seed + j, so the top leaves
# room for n (torch's generator takes [-2**63, 2**64 - 1]).
MAX_N = 128
# Far above any context window, far below what breaks a float or an int64 column.
MAX_TOKENS = 1 << 24
MAX_TOKEN_ID = 1 << 31
MAX_STOP_TOKEN_IDS = 256
MAX_JSON_DEPTH = 64
MAX_BODY_BYTES = 4 * 1024 * 1024
# Counts a replica or gateway reports (requests running or waiting, queue depth).
MAX_COUNT = 1 << 30

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenLimit = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
TokenId = Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# Seconds since the epoch: 0 .. year 9999 (datetime.fromtimestamp raises beyond).
Timestamp = Annotated[float, Field(ge=0.0, le=253_402_300_799.0, allow_inf_nan=False)]


class InputError(ValueError):
    """Input outside the bounds; the message says which and is safe to show a client.
    `reason` is a short label: json, depth, utf8, nonfinite, range."""

    def __init__(self, message: str, reason: str = "range") -> None:
        super().__init__(message)
        self.reason = reason


def text_problem(s: str) -> str | None:
    """Why a string cannot be UTF-8 (a lone surrogate from a JSON escape), or None."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"contains an unpaired surrogate (U+{ord(s[err.start]):04X}) at position {err.start}"
    return None


def check_tree(value: Any, max_depth: int = MAX_JSON_DEPTH, finite: bool = True) -> None:
    """Walk a decoded JSON value without recursion: depth, strings (keys included) and,
    with `finite`, numbers."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node)
            if problem is not None:
                raise InputError(f"A string in the request body {problem}; it is not valid UTF-8", "utf8")
            continue
        if finite and isinstance(node, float) and not math.isfinite(node):
            raise InputError("The request body contains a non-finite number (NaN or Infinity)", "nonfinite")
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            raise InputError(f"The request body is nested deeper than {max_depth} levels", "depth")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str):
                stack.append((k, depth))
            stack.append((v, depth + 1))


def _no_constant(name: str) -> Any:
    raise InputError(f"The request body is not valid JSON: {name} is not a JSON number", "nonfinite")


def load_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, finite: bool = True) -> Any:
    """`json.loads` with the bounds above; every failure is an `InputError`. `finite=False`
    leaves NaN and Infinity to the caller's own validation (its field-level message)."""
    try:
        value = json.loads(raw, parse_constant=_no_constant if finite else None)
    except RecursionError:
        raise InputError(f"The request body is nested deeper than {max_depth} levels", "depth") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"The request body is not valid JSON: {err}", "json") from None
    check_tree(value, max_depth, finite)
    return value


def bounded_int(value: Any, name: str, minimum: int, maximum: int) -> int:
    """An int within [minimum, maximum] (bools refused), or an InputError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"{name} must be an integer")
    if value < minimum:
        raise InputError(f"{name} must be at least {minimum}")
    if value > maximum:
        raise InputError(f"{name} must be at most {maximum}")
    return value
