"""Request traces: Azure LLM inference (CSV: TIMESTAMP, ContextTokens, GeneratedTokens: the
2023 conversation and code traces alike) and Mooncake (JSONL: timestamp in ms, input_length,
output_length, hash_ids), read into one shape with arrival times in seconds from the first request.

Mooncake's `hash_ids` name the prompt's blocks of `MOONCAKE_BLOCK_TOKENS` tokens, chained
(an id stands for a block and everything before it), which is what the simulator's
prefix caches and the prefix router key on; Azure traces carry no prefix information."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


class TraceError(ValueError):
    """A trace file that cannot be read (says which line and why)."""


MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    at: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # chained prefix-block ids, when the trace has them
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


_STAMP = re.compile(r"^(?P<head>[^.+Z]+?)(?:\.(?P<frac>\d+))?(?P<tz>Z|[+-]\d\d:?\d\d)?$")


def _azure_time(text: str) -> float:
    """ "2023-11-16 18:15:46.6805900" (seven fractional digits; datetime takes six), also
    with a UTC offset ("...+00:00", "Z") as later Azure traces write it."""
    m = _STAMP.match(text.strip())
    if m is None:
        raise ValueError(f"unreadable timestamp {text!r}")
    tz = m["tz"] or ""
    head = datetime.fromisoformat(m["head"] + ("+00:00" if tz == "Z" else tz))
    return head.timestamp() + (float("0." + m["frac"]) if m["frac"] else 0.0)


Row = tuple[float, int, int, tuple[int, ...]]


def _azure(path: Path) -> list[Row]:
    out = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or []):
            raise TraceError(f"{path}: an Azure trace needs columns {', '.join(sorted(need))}")
        for n, row in enumerate(reader, start=2):
            try:
                out.append(
                    (
                        _azure_time(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                        (),
                    )
                )
            except (ValueError, TypeError) as err:
                raise TraceError(f"{path}:{n}: {err}") from None
    return out


def _mooncake(path: Path) -> list[Row]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row.get("hash_ids") or []
                if not isinstance(ids, list):
                    raise TypeError("hash_ids must be a list of integers")
                out.append(
                    (
                        float(row["timestamp"]) / 1000.0,
                        int(row["input_length"]),
                        int(row["output_length"]),
                        tuple(int(h) for h in ids),
                    )
                )
            except (ValueError, KeyError, TypeError) as err:
                raise TraceError(f"{path}:{n}: {err!r}") from None
    return out


def _is_jsonl(path: Path) -> bool:
    """By content, not by name: a Mooncake trace is JSON lines, an Azure one a CSV (the
    conversation and code traces share its columns) whatever the files are called."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"{")


def load_trace(path: str | Path, rate_scale: float = 1.0, limit_s: float | None = None) -> list[TraceRequest]:
    """Requests sorted by arrival, from 0 s. `rate_scale` 2 replays twice as fast (twice
    the request rate); `limit_s` keeps only the first seconds of (scaled) trace."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    if rate_scale <= 0:
        raise TraceError("rate scale must be > 0")
    rows = _mooncake(p) if _is_jsonl(p) else _azure(p)
    if not rows:
        raise TraceError(f"{p}: no requests")
    rows.sort()
    t0 = rows[0][0]
    out = [TraceRequest((t - t0) / rate_scale, max(1, a), max(1, b), h) for t, a, b, h in rows]
    if limit_s is not None:
        out = [r for r in out if r.at <= limit_s]
    return out


# A pipeline trace (JSON lines): one pipeline request a line, its steps in call order, each
# with its own cost:
#   {"at": 12.5, "steps": [{"step": "embed", "prompt_tokens": 40, "output_tokens": 1},
#                          {"step": "answer", "prompt_tokens": 1900, "output_tokens": 220}]}
# Every line names the same steps in the same order.


@dataclass(frozen=True)
class StepCost:
    step: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class PipelineTraceRequest:
    at: float
    steps: tuple[StepCost, ...]


def is_pipeline_trace(path: str | Path) -> bool:
    """JSON lines whose first request has `steps`."""
    p = Path(path)
    if not p.is_file() or not _is_jsonl(p):
        return False
    with open(p, encoding="utf-8-sig") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except ValueError:
                    return False
                return isinstance(first, dict) and "steps" in first
    return False


def load_pipeline_trace(
    path: str | Path, rate_scale: float = 1.0, limit_s: float | None = None
) -> tuple[tuple[str, ...], list[PipelineTraceRequest]]:
    """(step names in call order, requests sorted by arrival from 0 s); `rate_scale` and
    `limit_s` as for `load_trace`."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    if rate_scale <= 0:
        raise TraceError("rate scale must be > 0")
    names: tuple[str, ...] | None = None
    rows: list[PipelineTraceRequest] = []
    with open(p, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                steps = tuple(
                    StepCost(str(s["step"]), max(1, int(s["prompt_tokens"])), max(1, int(s["output_tokens"])))
                    for s in obj["steps"]
                )
                at = float(obj["at"])
                if not math.isfinite(at):
                    raise ValueError(f"at {obj['at']!r} is not a finite number of seconds")
            except (ValueError, KeyError, TypeError) as err:
                raise TraceError(f"{p}:{n}: a pipeline request needs at and steps[step, prompt_tokens, "
                                 f"output_tokens]: {err}") from err  # fmt: skip
            if not steps:
                raise TraceError(f"{p}:{n}: no steps")
            these = tuple(s.step for s in steps)
            if names is None:
                names = these
            elif these != names:
                raise TraceError(f"{p}:{n}: steps {', '.join(these)}; the first line has {', '.join(names)}")
            rows.append(PipelineTraceRequest(at, steps))
    if not rows or names is None:
        raise TraceError(f"{p}: no requests")
    rows.sort(key=lambda r: r.at)
    t0 = rows[0].at
    out = [PipelineTraceRequest((r.at - t0) / rate_scale, r.steps) for r in rows]
    if limit_s is not None:
        out = [r for r in out if r.at <= limit_s]
    return names, out
