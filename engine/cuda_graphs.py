"""CUDA graphs of the decode step: the forward pass and logits replayed, not launched op by op.

A decode step of a small batch runs hundreds of short kernels; launched one by one from Python,
their launch cost exceeds their run time (eager Llama-3-8B at batch 1 on an H200: 27.7 ms a step,
7.7x the memory floor, with 1268 launches a step). A graph replays them all with one launch.

One graph per padded batch size (1, 2, 4, 8, then multiples of 8 up to max_num_seqs), all reading
the same static input buffers: a step copies its batch into the first B rows, pads the rest to
harmless rows (no KV write, one token of context), replays the smallest graph that holds B rows,
and reads B rows of logits. The page table is captured at its full width (max_pages_per_seq), so
the kernels' launch shapes never depend on the batch's contents.

Ordering: the graphs hold the addresses of the KV cache views, the static buffers and their own
memory pool, so they are captured once, after the KV cache is allocated, and live as long as it.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (vLLM's steps)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    """Captured decode steps of one model over one KV cache (CUDA only)."""

    def __init__(
        self,
        model: torch.nn.Module,  # engine.runner.PagedCausalLM
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        groups: list[str],
        max_num_seqs: int,
        max_pages_per_seq: int,
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            # one slot mapping and page table per KV pool group (full; each window size)
            self.slot_mappings = {g: torch.full((n,), -1, dtype=torch.int64) for g in groups}
            self.page_tables = {
                g: torch.zeros((n, max_pages_per_seq), dtype=torch.int32) for g in groups
            }
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32)
            self.logits_indices = torch.arange(n, dtype=torch.int64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _static_batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mappings={g: t[:size] for g, t in self.slot_mappings.items()},
            page_tables={g: t[:size] for g, t in self.page_tables.items()},
            seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_query_len=1,
            logits_indices=self.logits_indices[:size],
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.forward(batch, self.kv_caches)
        return self.model.compute_logits(hidden)  # every row: no gather inside the graph

    def capture(self) -> None:
        """Capture every size, largest first, so the smaller graphs reuse its memory pool. The
        static rows are harmless while capturing: slot -1 writes no KV, seq_len 1 reads page 0."""
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                batch = self._static_batch(size)
                for _ in range(2):  # compiles Triton kernels, sets up cuBLAS workspaces
                    self._forward(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._logits[size] = self._forward(batch)
                pool = graph.pool()
                self._graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def padded_size(self, batch: ForwardBatch) -> int | None:
        """The graph that runs ``batch``, or None when it must run eagerly (a prefill, more rows
        than the largest graph, or not every row sampled)."""
        b = batch.num_seqs
        if not batch.is_decode_only or b > self.sizes[-1] or batch.logits_indices.shape[0] != b:
            return None
        if batch.page_tables.keys() != self.page_tables.keys() or any(
            t.shape[1] > self.page_tables[g].shape[1] for g, t in batch.page_tables.items()
        ):
            return None
        return next(s for s in self.sizes if s >= b)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode step (its K/V written to the pages), or None (run it eagerly)."""
        size = self.padded_size(batch)
        if size is None or size not in self._graphs:
            return None
        b = batch.num_seqs
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        for g, table in batch.page_tables.items():
            self.slot_mappings[g][:b].copy_(batch.slot_mappings[g], non_blocking=True)
            # Columns past the batch's width keep older ids: no kernel reads past seq_lens.
            self.page_tables[g][:b, : table.shape[1]].copy_(table, non_blocking=True)
            if size > b:  # padding rows: write no KV, attend to one token of the null page
                self.slot_mappings[g][b:size].fill_(-1)
                self.page_tables[g][b:size, 0].fill_(0)
        if size > b:
            self.seq_lens[b:size].fill_(1)
        self._graphs[size].replay()
        return self._logits[size][:b]
