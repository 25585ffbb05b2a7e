"""The wire contract of stream continuation (Fleet extensions, between gateway and replica).

A gateway that streams a chat or completion asks the replica, with `TOKEN_IDS_HEADER`, to
put on every streamed choice the token ids generated since the previous chunk
(`TOKEN_IDS_FIELD`); it strips them before the client sees the chunk. When the replica
fails mid-stream, the gateway sends the same request to another replica with the ids it
collected in `RESUME_FIELD`: that replica prefills them after the prompt and goes on as if
the generation had never stopped (they count as output for `max_tokens`, stop strings,
usage), streaming only the text not yet sent. Ordinary clients never need either field.
"""

from __future__ import annotations

RESUME_FIELD = "fleet_resume_token_ids"
TOKEN_IDS_FIELD = "fleet_token_ids"
TOKEN_IDS_HEADER = "x-fleet-token-ids"
# The in-band error code of a stream the replica cut because its client stopped reading:
# the client's doing, so a gateway ends the stream instead of continuing it elsewhere.
SLOW_READER_CODE = "slow_reader"
