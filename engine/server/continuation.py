"""Token ids on streamed chunks, for the gateway that may continue the stream elsewhere.

Only a request carrying `TOKEN_IDS_HEADER` gets them (the gateway strips them before the
client), and a draining replica may end such a stream early (`Generation.hand_over`):
the gateway continues it elsewhere. Each chunk carries every token generated since the previous chunk of its choice,
including tokens of steps that produced no chunk (text held back, partial UTF-8), so the
ids a gateway holds always match the text it has forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from engine.server.generation import Generation
from fleet_base.openai_contract.continuation import TOKEN_IDS_FIELD, TOKEN_IDS_HEADER


@dataclass
class TokenIdsOut:
    """Per choice, how many of its output token ids the stream has carried so far."""

    start: int = 0  # a continuation's resumed tokens were carried by the original stream
    sent: dict[Any, int] = field(default_factory=dict)

    @classmethod
    def wanted(cls, request: Request, gen: Generation) -> TokenIdsOut | None:
        if request.headers.get(TOKEN_IDS_HEADER, "") not in ("1", "true"):
            return None
        if len(gen.prompts) == 1 and gen.params.n == 1:  # a drain may hand it over
            gen.allow_hand_over()
        return cls(start=len(gen.resume_token_ids or ()))

    def attach(self, choice: dict[str, Any], key: Any, token_ids: list[int]) -> None:
        at = self.sent.get(key, self.start)
        choice[TOKEN_IDS_FIELD] = token_ids[at:]
        self.sent[key] = len(token_ids)
