"""One sampling row per logits row: a verified chunk of k drafts samples k + 1 times.

Row j of a verified sequence sees the sequence as if drafts d_1..d_j were already its
output (penalties and min_tokens count them) and draws the noise of that output index, so
it is exactly the row an unspeculated step would sample there. Sequences without drafts
keep one row, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sampler import SamplerOutput
from engine.scheduler import ScheduledRequest
from engine.spec_decode.acceptance import accept_rows
from fleet_base.sampling_params import SamplingParams


@dataclass
class SamplingRows:
    params: list[SamplingParams] = field(default_factory=list)
    prompt_token_ids: list[Sequence[int]] = field(default_factory=list)
    output_token_ids: list[Sequence[int]] = field(default_factory=list)
    generators: list[Any] = field(default_factory=list)
    stop_token_ids: list[set[int]] = field(default_factory=list)
    grammars: list[Any] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # rows per sequence
    drafts: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        sampling: Sequence[tuple[ScheduledRequest, set[int]]],
        generator: Callable[[ScheduledRequest, int], Any],
    ) -> SamplingRows:
        """`generator(s, j)`: the seeded generator for output index num_output + j (or None)."""
        rows = cls()
        for s, stops in sampling:
            r = s.request
            drafts = r.spec_token_ids[: s.num_draft_tokens]
            rows.counts.append(len(drafts) + 1)
            rows.drafts.append(drafts)
            for j in range(len(drafts) + 1):
                rows.params.append(r.sampling_params)
                rows.prompt_token_ids.append(r.prompt_token_ids)
                rows.output_token_ids.append(r.output_token_ids + drafts[:j] if j else r.output_token_ids)
                rows.generators.append(generator(s, j))
                rows.stop_token_ids.append(stops)
                rows.grammars.append(r.grammar)
        return rows

    @property
    def speculative(self) -> bool:
        return any(self.drafts)

    def accept(self, out: SamplerOutput) -> SamplerOutput:
        """Per sequence, the accepted tokens (and their logprobs), flat; counts set when any
        sequence was verified."""
        if not self.speculative:
            return out
        sampled = out.token_ids
        tokens, counts, accepted = accept_rows(sampled, sampled, self.counts, self.drafts)
        logprobs = None
        if out.logprobs is not None:
            logprobs, _, _ = accept_rows(out.logprobs, sampled, self.counts, self.drafts)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, counts=counts, accepted=accepted)
