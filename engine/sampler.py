"""Batched sampling: one call per engine step turns last-position logits into next tokens.

Pipeline (vLLM order): raw logprobs -> min_tokens blocking of stop ids -> repetition /
frequency / presence penalties -> greedy argmax, or temperature -> top-k / top-p / min-p ->
exponential race. Every stage works on the whole batch at once and is skipped when no row
needs it; the only per-row Python work is the noise draw of seeded rows, which must use the
request's own generator so its tokens never depend on what else shares the batch.

Truncation (top-k / top-p / min-p) is expressed as a per-row probability threshold found among
the `num_candidates` most likely tokens (`topk`, far cheaper than sorting the vocabulary on
CPU); a row whose threshold is not decided inside the candidates falls back to a full sort.
Which path a row takes depends only on that row, and both give the same kept set.

`logits` passed to the sampler are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import SampleLogprobs, TokenLogprob
from engine.sampling_params import SamplingParams

DEFAULT_NUM_CANDIDATES = 256


@dataclass(frozen=True)
class _Penalties:
    """Penalty inputs for the rows that use any penalty (`rows` None: every row)."""

    rows: torch.Tensor | None  # [P] long, indices into the batch
    seen_tokens: torch.Tensor | None  # [P, Lp+Lo] prompt+output ids padded with vocab_size
    output_tokens: torch.Tensor | None  # [P, Lo] output ids padded with vocab_size
    repetition: torch.Tensor | None  # [P, 1]
    frequency: torch.Tensor | None  # [P, 1]
    presence: torch.Tensor | None  # [P, 1]


@dataclass(frozen=True)
class _Truncation:
    """top-k / top-p / min-p of the sampled rows that truncate (positions in the sampled set)."""

    rows: list[int]
    top_k: torch.Tensor  # [T] long, 0 = off
    top_p: torch.Tensor  # [T] float, 1 = off
    min_p: torch.Tensor  # [T] float, 0 = off
    max_top_k: int


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step tensors derived from the requests' params; built once, read by `Sampler`.

    Rows are split into greedy rows (argmax) and sampled rows; sampled rows further into
    plain rows (full-vocabulary race) and truncating rows. Index lists are Python-side so the
    sampler never has to sync to learn them.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    greedy_rows: torch.Tensor | None  # [G] long; None when no row is greedy
    sample_rows: torch.Tensor | None  # [S] long; None when no row samples
    all_sampled: bool  # sample_rows covers the whole batch in order
    temperature: torch.Tensor | None  # [S, 1]
    plain_rows: list[int]  # positions in the sampled set
    truncation: _Truncation | None
    generators: dict[int, torch.Generator]  # sampled-set position -> generator
    penalties: _Penalties | None
    blocked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf
    num_logprobs: list[int | None]
    logprob_rows: torch.Tensor | None  # [L] long; None when no row asks
    max_logprobs: int

    @property
    def fast_greedy(self) -> bool:
        """Nothing but argmax to do (the common benchmark case)."""
        return self.sample_rows is None and self.penalties is None and self.blocked is None

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
    ) -> SamplingBatch:
        n = len(params)
        if not (
            len(prompt_token_ids) == len(output_token_ids) == len(generators) == len(stop_token_ids) == n
        ):
            raise ValueError("all per-row sequences must have one entry per row")
        device = torch.device(device)

        def long_t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        def float_t(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]

        plain: list[int] = []
        trunc: list[int] = []
        gens: dict[int, torch.Generator] = {}
        for pos, i in enumerate(sampled):
            p = params[i]
            if 0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0:
                trunc.append(pos)
            else:
                plain.append(pos)
            gen = generators[i]
            if gen is None and p.seed is not None:
                raise ValueError(f"row {i} has a seed but no generator")
            if gen is not None:
                gens[pos] = gen

        truncation = None
        if trunc:
            ks = [params[sampled[pos]].top_k for pos in trunc]
            ks = [k if 0 < k < vocab_size else 0 for k in ks]
            truncation = _Truncation(
                rows=trunc,
                top_k=long_t(ks),
                top_p=float_t([params[sampled[pos]].top_p for pos in trunc]),
                min_p=float_t([params[sampled[pos]].min_p for pos in trunc]),
                max_top_k=max(ks),
            )

        blocked_rows: list[int] = []
        blocked_ids: list[int] = []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                ids = sorted(t for t in stop_token_ids[i] if 0 <= t < vocab_size)
                blocked_rows.extend([i] * len(ids))
                blocked_ids.extend(ids)
        blocked = (long_t(blocked_rows), long_t(blocked_ids)) if blocked_rows else None

        k_lp = [p.logprobs for p in params]
        lp_rows = [i for i, k in enumerate(k_lp) if k is not None]

        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            device=device,
            greedy_rows=long_t(greedy) if greedy else None,
            sample_rows=long_t(sampled) if sampled else None,
            all_sampled=len(sampled) == n,
            temperature=float_t([params[i].temperature for i in sampled]).unsqueeze(1) if sampled else None,
            plain_rows=plain,
            truncation=truncation,
            generators=gens,
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            blocked=blocked,
            num_logprobs=k_lp,
            logprob_rows=long_t(lp_rows) if lp_rows else None,
            max_logprobs=max((k for k in k_lp if k is not None), default=0),
        )


def _pad(rows: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([[*r, *([pad] * (width - len(r)))] for r in rows], dtype=torch.long, device=device)


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
    use_freq = any(p.frequency_penalty != 0.0 for p in ps)
    use_pres = any(p.presence_penalty != 0.0 for p in ps)

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    outputs = [output_token_ids[i] for i in rows]
    return _Penalties(
        rows=None if len(rows) == len(params) else torch.tensor(rows, dtype=torch.long, device=device),
        seen_tokens=_pad([[*prompt_token_ids[i], *output_token_ids[i]] for i in rows], vocab_size, device)
        if use_rep
        else None,
        output_tokens=_pad(outputs, vocab_size, device) if use_freq or use_pres else None,
        repetition=col([p.repetition_penalty for p in ps]) if use_rep else None,
        frequency=col([p.frequency_penalty for p in ps]) if use_freq else None,
        presence=col([p.presence_penalty for p in ps]) if use_pres else None,
    )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None] | None  # None when no row asked for logprobs


class Sampler:
    """Stateless; `num_candidates` trades a cheaper top-k pass for more full-sort fallbacks."""

    def __init__(self, num_candidates: int = DEFAULT_NUM_CANDIDATES) -> None:
        if num_candidates < 1:
            raise ValueError("num_candidates must be positive")
        self.num_candidates = num_candidates

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] < batch.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match the batch ({batch.num_rows} rows)")
        raw = logits[:, : batch.vocab_size]  # padded vocab columns are never sampled

        if batch.fast_greedy:
            tokens = raw.argmax(dim=-1)
        else:
            tokens = self._sample(raw, batch)
        token_list = tokens.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=_logprobs(raw, tokens, batch))

    @staticmethod
    def adjusted_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits after min_tokens blocking and penalties: what greedy rows take the argmax of.

        Returns `logits` itself (unmodified) when no row needs either.
        """
        x = logits[:, : batch.vocab_size]
        raw = x
        if batch.blocked is not None:
            x = x.clone()
            x[batch.blocked] = float("-inf")
        if batch.penalties is not None:
            x = _apply_penalties(x, batch.penalties, owned=x is not raw)
        return x

    def _sample(self, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        x = self.adjusted_logits(raw, batch)
        if batch.sample_rows is None:
            return x.argmax(dim=-1)
        assert batch.temperature is not None
        scaled = x if batch.all_sampled else x.index_select(0, batch.sample_rows)
        scaled = scaled / batch.temperature  # a fresh tensor either way
        sampled = self._race(scaled, batch)
        if batch.greedy_rows is None:
            return sampled
        tokens = torch.empty(batch.num_rows, dtype=torch.long, device=x.device)
        tokens[batch.greedy_rows] = x.index_select(0, batch.greedy_rows).argmax(dim=-1)
        tokens[batch.sample_rows] = sampled
        return tokens

    def _race(self, scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) draws token i with probability p_i."""
        probs = scaled.softmax(dim=-1)
        noise = _Noise(batch, probs.shape[0])
        tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        if batch.plain_rows:
            if len(batch.plain_rows) == probs.shape[0]:
                p = probs
                rows = batch.plain_rows
            else:
                rows = batch.plain_rows
                p = probs[_idx(rows, probs.device)]
            e = noise.exponential(rows, None)
            tokens[_idx(rows, probs.device)] = p.div_(e).argmax(dim=-1)
        if batch.truncation is not None:
            tokens[_idx(batch.truncation.rows, probs.device)] = self._truncated_race(
                probs, batch.truncation, noise
            )
        return tokens

    def _truncated_race(self, probs: torch.Tensor, tr: _Truncation, noise: _Noise) -> torch.Tensor:
        vocab = probs.shape[1]
        p = probs if len(tr.rows) == probs.shape[0] else probs[_idx(tr.rows, probs.device)]
        k = min(vocab, max(self.num_candidates, tr.max_top_k))
        complete = k == vocab
        cand_p, cand_i = p.sort(dim=-1, descending=True) if complete else p.topk(k, dim=-1)
        keep, decided = _keep_mask(cand_p, tr.top_k, tr.top_p, tr.min_p, complete)
        tokens = _race_candidates(cand_p, cand_i, keep, noise.exponential(tr.rows, cand_i))
        if not complete:
            undecided = (~decided).nonzero().squeeze(1)
            if undecided.numel():  # the threshold lies beyond the candidates: sort those rows
                sub = undecided.tolist()
                full_p, full_i = p[undecided].sort(dim=-1, descending=True)
                keep2, _ = _keep_mask(
                    full_p, tr.top_k[undecided], tr.top_p[undecided], tr.min_p[undecided], True
                )
                e2 = noise.exponential([tr.rows[j] for j in sub], full_i)
                tokens[undecided] = _race_candidates(full_p, full_i, keep2, e2)
        return tokens


def _idx(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


class _Noise:
    """Exp(1) noise for the sampled rows of one step.

    Seeded rows draw one uniform per vocabulary entry from their own generator, once per step,
    so token `t` always meets noise `u[t]` whichever path the row takes. Unseeded rows draw
    only the shape they need from the global generator. Exp(1) = -log(U) (inversion is ~4x
    faster than `exponential_` on CPU); U = 0 gives +inf noise, i.e. that token just loses.
    """

    def __init__(self, batch: SamplingBatch, num_sampled: int) -> None:
        self.seeded: dict[int, torch.Tensor] = {}
        for pos, gen in batch.generators.items():
            self.seeded[pos] = torch.empty(batch.vocab_size, device=batch.device).uniform_(generator=gen)
        self.device = batch.device
        self.vocab = batch.vocab_size

    def exponential(self, rows: list[int], index: torch.Tensor | None) -> torch.Tensor:
        """Noise for sampled-set `rows`, at token ids `index` [n, K] (None: every token)."""
        width = self.vocab if index is None else index.shape[1]
        u = torch.rand(len(rows), width, device=self.device)
        for i, r in enumerate(rows):
            own = self.seeded.get(r)
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
    """Which candidates (probs sorted descending, [n, K]) survive top-k, top-p, min-p.

    Each filter is a probability threshold, so ties at a boundary are all kept. Returns the
    keep mask and, per row, whether the kept set is decided by these candidates (always true
    when `complete`, i.e. the candidates are the whole vocabulary).
    """
    width = cand_p.shape[1]
    k_on = (top_k > 0).unsqueeze(1)
    kth = cand_p.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1))
    thresh = torch.where(k_on, kth, torch.zeros_like(kth))

    # top-p over the top-k-renormalized distribution: the smallest prefix holding p of the mass.
    kept_k = torch.where(cand_p >= thresh, cand_p, torch.zeros_like(cand_p))
    csum = kept_k.cumsum(dim=1)
    total = torch.where(k_on, csum[:, -1:], torch.ones_like(kth))
    first = (csum < top_p.unsqueeze(1) * total).sum(dim=1, keepdim=True)
    p_on = (top_p < 1.0).unsqueeze(1)
    pth = cand_p.gather(1, first.clamp(max=width - 1))
    thresh = torch.where(p_on, torch.maximum(thresh, pth), thresh)

    thresh = torch.maximum(thresh, min_p.unsqueeze(1) * cand_p[:, :1])
    keep = cand_p >= thresh
    if complete:
        return keep, torch.ones(cand_p.shape[0], dtype=torch.bool, device=cand_p.device)
    last = cand_p[:, -1:]
    found = ~p_on | (first < width)
    decided = found & ((last < thresh) | (last == 0))
    return keep, decided.squeeze(1)


def _race_candidates(
    cand_p: torch.Tensor, cand_i: torch.Tensor, keep: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    score = torch.where(keep, cand_p / noise, torch.full_like(cand_p, -1.0))
    return cand_i.gather(1, score.argmax(dim=1, keepdim=True)).squeeze(1)


def _apply_penalties(x: torch.Tensor, pen: _Penalties, owned: bool) -> torch.Tensor:
    """HF repetition penalty on prompt+output tokens; OpenAI frequency/presence on outputs."""
    sub = x if pen.rows is None else x.index_select(0, pen.rows)
    n, vocab = sub.shape
    if pen.repetition is not None and pen.seen_tokens is not None:
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, pen.seen_tokens, True)
        seen = seen[:, :vocab]
        rep = pen.repetition
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if pen.output_tokens is not None:
        counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=x.device)
        counts.scatter_add_(1, pen.output_tokens, torch.ones_like(pen.output_tokens, dtype=torch.float32))
        counts = counts[:, :vocab]
        if pen.frequency is not None:
            sub = sub - pen.frequency * counts
        if pen.presence is not None:
            sub = sub - pen.presence * (counts > 0).to(sub.dtype)
    if pen.rows is None:
        return sub
    out = x if owned else x.clone()
    out[pen.rows] = sub
    return out


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
) -> list[SampleLogprobs | None] | None:
    """Raw model logprobs (before any penalty or temperature), as vLLM reports them."""
    if batch.logprob_rows is None:
        return None
    rows = batch.logprob_rows
    lp = raw.index_select(0, rows).log_softmax(dim=-1)
    chosen = tokens.index_select(0, rows)
    sampled_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    if batch.max_logprobs > 0:
        top_v, top_i = lp.topk(min(batch.max_logprobs, lp.shape[1]), dim=-1)
        top_vals, top_ids = top_v.tolist(), top_i.tolist()
    out: list[SampleLogprobs | None] = [None] * batch.num_rows
    for j, (row, tok) in enumerate(zip(rows.tolist(), chosen.tolist(), strict=True)):
        k = min(batch.num_logprobs[row] or 0, lp.shape[1])
        top = [TokenLogprob(top_ids[j][m], "", top_vals[j][m]) for m in range(k)] if k else []
        out[row] = SampleLogprobs(sampled=TokenLogprob(tok, "", sampled_lp[j]), top=top)
    return out
