"""Batched sampling: one call per engine step turns last-position logits into next tokens.

Pipeline (vLLM order): raw logprobs -> min_tokens blocking of stop ids -> repetition /
frequency / presence penalties -> greedy argmax, or temperature -> top-k / top-p / min-p ->
exponential race. Every stage works on the whole batch at once and is skipped when no row
needs it; the only per-row Python work is the noise draw of seeded rows, which must use the
request's own generator so its tokens never depend on what else shares the batch.

Truncation (top-k / top-p / min-p) is expressed as a per-row probability threshold, found
among a row's most likely tokens (`topk`, far cheaper than sorting the vocabulary on CPU); a
row whose threshold is not decided inside its candidates retries with 16x more, ending in a
full sort. Which round decides a row depends only on that row, and every round gives the same
kept set.

The `logits` handed to the sampler are never modified.

Over ~400 lines: the stages of one batched pipeline, kept in their vLLM order in one file
so the order is visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.grammar import apply_bitmask_
from engine.outputs import SampleLogprobs, TokenLogprob
from fleet_base.sampling_params import SamplingParams

DEFAULT_NUM_CANDIDATES = 256
_WIDEN = 16  # candidate growth factor per undecided round


@dataclass(frozen=True)
class _Rows:
    """A subset of some row set: Python positions plus the matching index tensor.

    `index` is None when the subset is the whole parent set in order, so no copy is needed.
    """

    positions: list[int]
    index: torch.Tensor | None

    @classmethod
    def of(cls, positions: list[int], total: int, device: torch.device) -> _Rows:
        whole = positions == list(range(total))
        return cls(positions, None if whole else torch.tensor(positions, dtype=torch.long, device=device))

    def select(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is None else x[self.index]


@dataclass(frozen=True)
class _Penalties:
    """Penalty inputs for the rows that use any penalty.

    Token tensors are padded with a token already in the row (0 for an empty row), so the
    gather -> penalize -> scatter round trip writes identical values for duplicates.
    """

    rows: _Rows  # positions in the batch
    seen_tokens: torch.Tensor | None  # [P, Ls] prompt + output ids
    output_tokens: torch.Tensor | None  # [P, Lo] output ids
    output_counting: torch.Tensor | None  # [P, Lo] output ids padded with vocab_size (a spare column)
    repetition: torch.Tensor | None  # [P, 1]; 1.0 for rows with nothing seen
    frequency: torch.Tensor | None  # [P, 1]
    presence: torch.Tensor | None  # [P, 1]


@dataclass(frozen=True)
class _Truncation:
    """top-k / top-p / min-p of the truncating rows (positions in the sampled set)."""

    rows: _Rows
    top_k: torch.Tensor  # [T] long, 0 = off
    top_p: torch.Tensor  # [T] float, 1 = off
    min_p: torch.Tensor  # [T] float, 0 = off
    max_top_k: int


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step tensors derived from the requests' params; built once, read by `Sampler`.

    Rows split into greedy rows (argmax) and sampled rows; sampled rows further into plain rows
    (full-vocabulary race) and truncating rows. Row sets are known on the Python side so the
    sampler never syncs to learn them.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    greedy: _Rows | None  # positions in the batch
    sampled: _Rows | None  # positions in the batch
    temperature: torch.Tensor | None  # [S, 1]; None when every sampled row uses 1.0
    plain: _Rows | None  # positions in the sampled set
    truncation: _Truncation | None
    generators: dict[int, torch.Generator]  # sampled-set position -> the request's generator
    penalties: _Penalties | None
    blocked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    num_logprobs: list[int | None]
    logprob_rows: _Rows | None  # positions in the batch
    max_logprobs: int
    # [rows, ceil(V/32)] int32 allowed-token bits of constrained rows (structured outputs)
    token_bitmask: torch.Tensor | None = None

    @property
    def fast_greedy(self) -> bool:
        """Nothing but argmax to do (the common benchmark case)."""
        return (
            self.sampled is None
            and self.penalties is None
            and self.blocked is None
            and self.token_bitmask is None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        stop_token_ids: Sequence[set[int]],
        vocab_size: int,
        device: torch.device | str,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        n = len(params)
        if not (
            len(prompt_token_ids) == len(output_token_ids) == len(generators) == len(stop_token_ids) == n
        ):
            raise ValueError("all per-row sequences must have one entry per row")
        device = torch.device(device)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        plain: list[int] = []
        trunc: list[int] = []
        gens: dict[int, torch.Generator] = {}
        for pos, i in enumerate(sampled):
            p = params[i]
            (trunc if 0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0 else plain).append(pos)
            gen = generators[i]
            if gen is None and p.seed is not None:
                raise ValueError(f"row {i} has a seed but no generator")
            if gen is not None:
                gens[pos] = gen

        temps = [params[i].temperature for i in sampled]
        k_lp = [p.logprobs for p in params]
        lp_rows = [i for i, k in enumerate(k_lp) if k is not None]
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            device=device,
            greedy=_Rows.of(greedy, n, device) if greedy else None,
            sampled=_Rows.of(sampled, n, device) if sampled else None,
            temperature=_column(temps, device) if any(t != 1.0 for t in temps) else None,
            plain=_Rows.of(plain, len(sampled), device) if plain else None,
            truncation=_build_truncation(params, sampled, trunc, vocab_size, device),
            generators=gens,
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            blocked=_build_blocked(params, output_token_ids, stop_token_ids, vocab_size, device),
            num_logprobs=k_lp,
            logprob_rows=_Rows.of(lp_rows, n, device) if lp_rows else None,
            max_logprobs=max((k for k in k_lp if k is not None), default=0),
            token_bitmask=token_bitmask,
        )


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _build_truncation(
    params: Sequence[SamplingParams],
    sampled: list[int],
    trunc: list[int],
    vocab_size: int,
    device: torch.device,
) -> _Truncation | None:
    if not trunc:
        return None
    ps = [params[sampled[pos]] for pos in trunc]
    ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in ps]
    return _Truncation(
        rows=_Rows.of(trunc, len(sampled), device),
        top_k=torch.tensor(ks, dtype=torch.long, device=device),
        top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device),
        max_top_k=max(ks),
    )


def _build_blocked(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    stop_token_ids: Sequence[set[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) < p.min_tokens:
            stops = sorted(t for t in stop_token_ids[i] if 0 <= t < vocab_size)
            rows.extend([i] * len(stops))
            ids.extend(stops)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(ids, dtype=torch.long, device=device),
    )


def _pad(rows: list[list[int]], pad: int | None, device: torch.device) -> torch.Tensor:
    """Right-pad to a rectangle with `pad`, or (None) with the row's own first token."""
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor(
        [[*r, *([(r[0] if r else 0) if pad is None else pad] * (width - len(r)))] for r in rows],
        dtype=torch.long,
        device=device,
    )


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> _Penalties | None:
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return None
    ps = [params[i] for i in rows]
    use_rep = any(p.repetition_penalty != 1.0 for p in ps)
    use_count = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps)
    seen = [[*prompt_token_ids[i], *output_token_ids[i]] for i in rows] if use_rep else []
    outputs = [list(output_token_ids[i]) for i in rows] if use_count else []
    return _Penalties(
        rows=_Rows.of(rows, len(params), device),
        seen_tokens=_pad(seen, None, device) if use_rep else None,
        output_tokens=_pad(outputs, None, device) if use_count else None,
        output_counting=_pad(outputs, vocab_size, device) if use_count else None,
        repetition=_column(
            [p.repetition_penalty if s else 1.0 for p, s in zip(ps, seen, strict=True)], device
        )
        if use_rep
        else None,
        frequency=_column([p.frequency_penalty for p in ps], device) if use_count else None,
        presence=_column([p.presence_penalty for p in ps], device) if use_count else None,
    )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None] | None  # None when no row asked for logprobs
    # embedding requests whose last prompt chunk ran this step: request id -> vector
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # Speculative steps (engine.spec_decode): tokens kept per sequence (token_ids and logprobs
    # hold them back to back) and drafts accepted per sequence; None: one token each.
    counts: list[int] | None = None
    accepted: list[int] | None = None


class Sampler:
    """Stateless. `num_candidates`: size of the first top-k pass used for truncation."""

    def __init__(self, num_candidates: int = DEFAULT_NUM_CANDIDATES) -> None:
        if num_candidates < 1:
            raise ValueError("num_candidates must be positive")
        self.num_candidates = num_candidates

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] < batch.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match the batch ({batch.num_rows} rows)")
        raw = logits[:, : batch.vocab_size]  # padded vocab columns are never sampled
        tokens = raw.argmax(dim=-1) if batch.fast_greedy else self._sample(raw, batch)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=_logprobs(raw, tokens, batch))

    @staticmethod
    def adjusted_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits after grammar masks, min_tokens blocking and penalties: what greedy rows take
        the argmax of. A new tensor, or `logits` itself (unmodified) when no row needs any.
        """
        raw = logits[:, : batch.vocab_size]
        if batch.blocked is None and batch.penalties is None and batch.token_bitmask is None:
            return raw
        x = raw.clone()
        if batch.token_bitmask is not None:
            apply_bitmask_(x, batch.token_bitmask, batch.vocab_size)
        if batch.blocked is not None:
            x[batch.blocked] = float("-inf")
        if batch.penalties is not None:
            _apply_penalties_(x, batch.penalties)
        return x

    def _sample(self, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        x = self.adjusted_logits(raw, batch)
        if batch.sampled is None:
            return x.argmax(dim=-1)
        scaled = batch.sampled.select(x)
        if batch.temperature is not None:
            scaled = scaled / batch.temperature
        sampled = self._race(scaled.softmax(dim=-1), batch)
        if batch.greedy is None:
            return sampled
        assert batch.sampled.index is not None and batch.greedy.index is not None
        tokens = torch.empty(batch.num_rows, dtype=torch.long, device=x.device)
        tokens[batch.greedy.index] = x[batch.greedy.index].argmax(dim=-1)
        tokens[batch.sampled.index] = sampled
        return tokens

    def _race(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., picks token i with probability p_i."""
        noise = _Noise(batch)
        if batch.truncation is None:  # every row plain: race in place over the whole vocabulary
            assert batch.plain is not None
            return probs.div_(noise.exponential(batch.plain.positions, None)).argmax(dim=-1)
        tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        if batch.plain is not None:
            assert batch.plain.index is not None
            p = probs[batch.plain.index]
            tokens[batch.plain.index] = p.div_(noise.exponential(batch.plain.positions, None)).argmax(-1)
        trunc_tokens = self._truncated_race(batch.truncation.rows.select(probs), batch.truncation, noise)
        if batch.truncation.rows.index is None:
            return trunc_tokens
        tokens[batch.truncation.rows.index] = trunc_tokens
        return tokens

    def _truncated_race(self, probs: torch.Tensor, tr: _Truncation, noise: _Noise) -> torch.Tensor:
        """Race among each row's kept tokens, widening the candidate set for undecided rows."""
        n, vocab = probs.shape
        tokens = torch.empty(n, dtype=torch.long, device=probs.device)
        pending: torch.Tensor | None = None  # rows of `probs` still undecided; None: all
        width = max(self.num_candidates, tr.max_top_k)
        while True:
            sub = probs if pending is None else probs[pending]
            complete = width >= vocab
            cand_p, cand_i = sub.sort(dim=-1, descending=True) if complete else sub.topk(width, dim=-1)
            if pending is None:
                k, p, m = tr.top_k, tr.top_p, tr.min_p
            else:
                k, p, m = tr.top_k[pending], tr.top_p[pending], tr.min_p[pending]
            keep, decided = _keep_mask(cand_p, k, p, m, complete)
            positions = (
                tr.rows.positions if pending is None else [tr.rows.positions[j] for j in pending.tolist()]
            )
            chosen = _race_candidates(cand_p, cand_i, keep, noise.exponential(positions, cand_i))
            if pending is None:
                tokens = chosen
            else:
                tokens[pending] = chosen  # undecided rows are overwritten in a later round
            if complete:
                return tokens
            undecided = (~decided).nonzero().squeeze(1)
            if undecided.numel() == 0:
                return tokens
            pending = undecided if pending is None else pending[undecided]
            width *= _WIDEN


class _Noise:
    """Exp(1) noise for the sampled rows of one step.

    A seeded row draws one uniform per vocabulary entry from its own generator, once per step,
    so token t always meets the same noise whichever path or round the row goes through.
    Unseeded rows draw just the shape needed from the global generator. Exp(1) = -log(U):
    inversion is ~4x faster than `exponential_` on CPU; U = 0 gives +inf noise (that token
    simply loses) and U < 1 keeps the noise positive.
    """

    def __init__(self, batch: SamplingBatch) -> None:
        self.device = batch.device
        self.vocab = batch.vocab_size
        self.seeded = {
            pos: torch.empty(self.vocab, device=self.device).uniform_(generator=gen)
            for pos, gen in batch.generators.items()
        }

    def exponential(self, positions: list[int], index: torch.Tensor | None) -> torch.Tensor:
        """Noise for sampled-set `positions` at token ids `index` [n, K] (None: every token)."""
        u = torch.rand(len(positions), self.vocab if index is None else index.shape[1], device=self.device)
        if self.seeded:
            for i, pos in enumerate(positions):
                own = self.seeded.get(pos)
                if own is not None:
                    u[i] = own if index is None else own[index[i]]
        return u.log_().neg_()


def _keep_mask(
    cand_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    complete: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which candidates (probs sorted descending, [n, K]) survive top-k, top-p and min-p.

    Each filter is a probability threshold, so ties at a boundary are all kept. Returns the
    keep mask and, per row, whether these candidates decide the kept set (always when
    `complete`, i.e. the candidates are the whole vocabulary).
    """
    width = cand_p.shape[1]
    k_on = (top_k > 0).unsqueeze(1)
    kth = cand_p.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1))
    thresh = torch.where(k_on, kth, torch.zeros_like(kth))

    # top-p over the top-k-renormalized distribution: the smallest prefix holding p of the mass.
    csum = torch.where(cand_p >= thresh, cand_p, torch.zeros_like(cand_p)).cumsum(dim=1)
    total = torch.where(k_on, csum[:, -1:], torch.ones_like(kth))
    first = (csum < top_p.unsqueeze(1) * total).sum(dim=1, keepdim=True)
    p_on = (top_p < 1.0).unsqueeze(1)
    pth = cand_p.gather(1, first.clamp(max=width - 1))
    thresh = torch.where(p_on, torch.maximum(thresh, pth), thresh)

    thresh = torch.maximum(thresh, min_p.unsqueeze(1) * cand_p[:, :1])
    keep = cand_p >= thresh
    if complete:
        return keep, torch.ones(cand_p.shape[0], dtype=torch.bool, device=cand_p.device)
    # Decided when top-p found its cut here and no token past the candidates can be kept.
    last = cand_p[:, -1:]
    decided = (~p_on | (first < width)) & ((last < thresh) | (last == 0))
    return keep, decided.squeeze(1)


def _race_candidates(
    cand_p: torch.Tensor, cand_i: torch.Tensor, keep: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    score = torch.where(keep, cand_p / noise, torch.full_like(cand_p, -1.0))
    return cand_i.gather(1, score.argmax(dim=1, keepdim=True)).squeeze(1)


def _apply_penalties_(x: torch.Tensor, pen: _Penalties) -> None:
    """In place: HF repetition penalty on prompt+output tokens, then OpenAI frequency/presence
    on output tokens. Only the touched entries are read and written (gather/scatter), so the
    cost scales with the tokens, not the vocabulary (except the one count tensor)."""
    n = len(pen.rows.positions)
    rows = (pen.rows.index if pen.rows.index is not None else torch.arange(n, device=x.device)).unsqueeze(1)
    if pen.seen_tokens is not None and pen.repetition is not None:
        v = x[rows, pen.seen_tokens]
        x[rows, pen.seen_tokens] = torch.where(v > 0, v / pen.repetition, v * pen.repetition)
    if pen.output_tokens is not None and pen.output_counting is not None:
        assert pen.frequency is not None and pen.presence is not None
        counts = torch.zeros(n, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        counts.scatter_add_(1, pen.output_counting, torch.ones_like(pen.output_counting, dtype=x.dtype))
        c = counts.gather(1, pen.output_tokens)
        x[rows, pen.output_tokens] -= pen.frequency * c + pen.presence * (c > 0).to(x.dtype)


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
) -> list[SampleLogprobs | None] | None:
    """Raw model logprobs (before any penalty or temperature), as vLLM reports them."""
    if batch.logprob_rows is None:
        return None
    lp = batch.logprob_rows.select(raw).log_softmax(dim=-1)
    chosen = batch.logprob_rows.select(tokens)
    sampled_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k_max = min(batch.max_logprobs, lp.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k_max > 0:
        top_v, top_i = lp.topk(k_max, dim=-1)
        top_vals, top_ids = top_v.tolist(), top_i.tolist()
    out: list[SampleLogprobs | None] = [None] * batch.num_rows
    for j, (row, tok) in enumerate(zip(batch.logprob_rows.positions, chosen.tolist(), strict=True)):
        k = min(batch.num_logprobs[row] or 0, k_max)
        top = [TokenLogprob(top_ids[j][m], "", top_vals[j][m]) for m in range(k)]
        out[row] = SampleLogprobs(sampled=TokenLogprob(tok, "", sampled_lp[j]), top=top)
    return out
