"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step of a small model on a GPU is launch-bound: hundreds of kernels of a few
microseconds each. A step whose tokens are all decodes is padded up to the next bucket,
copied into static input buffers and replayed from the graph captured for that bucket.
Padding rows write no KV (slot -1) and attend to one slot of block 0; their logits are
dropped. Block tables are always `max_blocks` wide so a graph fits every context length (the
Triton decode kernel stops at each row's context length). Mixed or prefill steps run eager.

Not run in CI (no GPU there): `bench/gpu_all.py` checks it against the eager path on CUDA.
"""

from __future__ import annotations

import bisect

import torch

from engine.model.llama import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks = max_blocks
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.logits_idx = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def applies(self, meta: AttentionMetadata, num_tokens: int, logits_rows: int) -> bool:
        """Decodes only, every one sampling, a single attention group, a bucket that fits."""
        return (
            meta.num_decode_tokens == num_tokens
            and logits_rows == num_tokens
            and len(meta.decode_groups) == 1
            and meta.decode_groups[0][2].shape[1] <= self.max_blocks
            and self.bucket(num_tokens) is not None
        )

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode_tokens=b,
            decode_groups=[(0, b, self.tables[:b], self.lens[:b])],
            prefill_block_tables=None,
            prefill_query_start_loc=None,
            prefill_context_lens=None,
        )

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b), self.logits_idx[:b]
        )

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b)
        return graph, out

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] for a decode-only step (`applies` was true)."""
        n = input_ids.shape[0]
        b = self.bucket(n)
        assert b is not None
        _, _, tables, lens = meta.decode_groups[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, : tables.shape[1]].copy_(tables)
        self.lens[:n].copy_(lens)
        if b > n:  # padding rows: no KV write, one slot of attention, logits dropped
            self.slots[n:b].fill_(-1)
            self.lens[n:b].fill_(1)
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
