"""Token ids on streamed chunks, for the gateway that may continue the stream elsewhere.

Only a request carrying `TOKEN_IDS_HEADER` gets them (the gateway strips them before the
client), and a draining replica may end such a stream early (`Generation.hand_over`):
the gateway continues it elsewhere. Each chunk carries every token generated since the previous chunk of its choice,
including tokens of steps that produced no chunk (text held back, partial UTF-8), so the
ids a gateway holds always match the text it has forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from engine.server.generation import Generation
from fleet_base.openai_contract.continuation import TOKEN_IDS_FIELD, TOKEN_IDS_HEADER


@dataclass
class TokenIdsOut:
    """Puts on a chunk the token ids its choice generated since its previous chunk."""

    gen: Generation

    @classmethod
    def wanted(cls, request: Request, gen: Generation) -> TokenIdsOut | None:
        if request.headers.get(TOKEN_IDS_HEADER, "") not in ("1", "true"):
            return None
        if len(gen.prompts) == 1 and gen.params.n == 1:  # a drain may hand it over
            gen.allow_hand_over()
        gen.keep_token_ids = True  # a continuation's resumed ids are not output again
        return cls(gen)

    def attach(self, choice: dict[str, Any], key: tuple[int, int]) -> None:
        choice[TOKEN_IDS_FIELD] = self.gen.choices[key].take_ids()
