"""Server-sent events passed through one event at a time, observed on the way.

The gateway forwards each complete event as soon as its last byte arrives (no buffering
beyond one event), reads from it what telemetry needs (first token, usage, errors), and
drops the usage chunk it asked the replica for when the client did not ask for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DELIMITERS = (b"\n\n", b"\r\n\r\n")


class EventSplitter:
    """Bytes in, complete events (each with its trailing blank line) out."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        events: list[bytes] = []
        while True:
            cut = -1
            for delim in _DELIMITERS:
                at = self._buf.find(delim)
                if at >= 0 and (cut < 0 or at + len(delim) < cut):
                    cut = at + len(delim)
            if cut < 0:
                return events
            events.append(self._buf[:cut])
            self._buf = self._buf[cut:]

    def rest(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


def event_data(event: bytes) -> bytes | None:
    """The payload of an SSE event's `data:` lines (None: the event has none)."""
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


@dataclass(frozen=True)
class SseEvent:
    """One event as the stream's readers see it: the end marker, or its JSON object
    (None for anything else, which is passed on untouched)."""

    raw: bytes
    done: bool = False
    payload: dict[str, Any] | None = None

    @classmethod
    def parse(cls, raw: bytes) -> SseEvent:
        data = event_data(raw)
        if data is None:
            return cls(raw)
        if data.strip() == b"[DONE]":
            return cls(raw, done=True)
        try:
            payload = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return cls(raw)
        return cls(raw, payload=payload if isinstance(payload, dict) else None)

    @property
    def error(self) -> dict[str, Any] | None:
        error = self.payload.get("error") if self.payload is not None else None
        return error if isinstance(error, dict) else None


def encode_event(payload: dict[str, Any]) -> bytes:
    """A JSON object as one `data:` event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class StreamObserver:
    """Watches an OpenAI SSE stream; `observe` returns the bytes to forward (maybe none)."""

    strip_usage: bool
    usage: dict[str, Any] | None = None
    first_token: bool = False
    done: bool = False
    error: dict[str, Any] | None = None
    # choice deltas that carried text: the tokens the client got (the engine streams one
    # per step per sequence), charged when a stream ends without its usage chunk
    tokens_seen: int = 0
    # receives the first choice's text as it streams (a shadow copy's comparison holds it)
    on_text: Callable[[str], None] | None = None

    def observe(self, event: bytes) -> bytes | None:
        parsed = SseEvent.parse(event)
        if parsed.done:
            self.done = True
            return event
        payload = parsed.payload
        if payload is None:
            return event
        if parsed.error is not None:
            self.error = parsed.error
            return event
        kind = payload.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            return self._responses_event(kind, payload, event)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = payload.get("choices")
        if isinstance(choices, list):
            carried = sum(1 for c in choices if _has_text(c))
            if self.on_text is not None:
                for c in choices:
                    text = choice_text(c)
                    if text:
                        self.on_text(text)
            self.tokens_seen += carried
            if not self.first_token and (carried or any(_has_token(c) for c in choices)):
                self.first_token = True
        if not self.strip_usage or "usage" not in payload:
            return event
        if usage is not None and not choices:
            return None  # the usage chunk the client did not ask for
        del payload["usage"]
        return encode_event(payload)

    def _responses_event(self, kind: str, payload: dict[str, Any], event: bytes) -> bytes:
        """A Responses API event: tokens on deltas, usage and the end on the final event."""
        if kind in _RESPONSE_TOKENS:
            self.first_token = True
        if kind in _RESPONSE_ENDS:
            self.done = True
            response = payload.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            if isinstance(usage, dict):
                self.usage = usage
        return event


_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")
_RESPONSE_TOKENS = ("response.output_text.delta", "response.function_call_arguments.delta")


def choice_text(choice: Any) -> str:
    """The text a streamed chunk's choice carries, for choice 0 only ("" otherwise)."""
    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
        return ""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(isinstance(delta, dict) and delta.get("content")) or bool(choice.get("text"))


def _has_token(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict) and delta.get("content"):
        return True
    return bool(choice.get("text")) or choice.get("finish_reason") is not None
