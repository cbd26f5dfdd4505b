"""Turns a scheduling decision into the tensors of one forward pass (engine.forward_batch.ForwardBatch).

Runs every step, so the per-request Python work is a few attribute reads; the arithmetic is numpy
over the whole batch. Page tables are persistent, one per KV pool group: each running request owns a
row (the same index in every group's table) that is written once per new page and once per page a
window releases, so a decode step copies rows instead of rebuilding lists of page ids.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.request import Request
from engine.scheduler_output import SchedulerOutput
from kvcache.spec import FULL_GROUP, NULL_PAGE


class PageTableRows:
    """Per pool group, rows ``[num_rows, max_pages_per_seq]`` int32 of page ids, padded with the null
    page; a request has the same row in every group."""

    def __init__(self, groups: list[str], max_pages_per_seq: int, num_rows: int = 64) -> None:
        self.groups = list(groups)
        self.max_pages_per_seq = max_pages_per_seq
        self.tables = {
            g: np.full((num_rows, max_pages_per_seq), NULL_PAGE, dtype=np.int32) for g in groups
        }
        self._num_synced: dict[str, list[int]] = {g: [0] * num_rows for g in groups}
        self._num_nulled: dict[str, list[int]] = {g: [0] * num_rows for g in groups}
        self._seen: list[dict[str, list[int]] | None] = [None] * num_rows  # last synced page_ids
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)

    def row(self, request: Request) -> int:
        """The request's row, created on first use, with its page lists synced in.

        The scheduler gives a request a fresh ``page_ids`` dict after every allocation, so an
        unchanged dict (the usual decode step) needs no work. Page lists only grow while a request
        runs, and a window group's leading entries only turn into the null page
        (kvcache/request_pages.py); a request whose pages are replaced (preempted, then
        readmitted) must be released first (``SchedulerOutput.released_ids``).
        """
        row = self._row_of.get(request.request_id)
        if row is None:
            row = self._new_row(request.request_id)
        page_ids = request.page_ids
        if page_ids is not self._seen[row]:
            for g in self.groups:
                self._sync(g, row, page_ids[g], request.request_id)
            self._seen[row] = page_ids
        return row

    def _sync(self, g: str, row: int, pages: list[int], request_id: str) -> None:
        table, synced = self.tables[g], self._num_synced[g][row]
        if len(pages) != synced:
            if len(pages) < synced:  # the request's pages were replaced: rewrite the row
                table[row, :synced] = NULL_PAGE
                synced = self._num_nulled[g][row] = 0
            if len(pages) > self.max_pages_per_seq:
                raise ValueError(
                    f"request {request_id!r} holds {len(pages)} pages, more than "
                    f"max_pages_per_seq={self.max_pages_per_seq}"
                )
            table[row, synced : len(pages)] = pages[synced:]
            self._num_synced[g][row] = len(pages)
        nulled = end = self._num_nulled[g][row]
        while end < len(pages) and pages[end] == NULL_PAGE:
            end += 1
        if end > nulled:  # pages that left the window
            table[row, nulled:end] = NULL_PAGE
            self._num_nulled[g][row] = end

    def release(self, request_id: str) -> None:
        """Forget a request that left the running set (unknown ids are a no-op)."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        for g in self.groups:
            self.tables[g][row, : self._num_synced[g][row]] = NULL_PAGE
            self._num_synced[g][row] = self._num_nulled[g][row] = 0
        self._seen[row] = None
        self._free_rows.append(row)

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:
            old = len(self._num_synced[self.groups[0]])
            for g in self.groups:
                grown = np.full((old * 2, self.max_pages_per_seq), NULL_PAGE, dtype=np.int32)
                grown[:old] = self.tables[g]
                self.tables[g] = grown
                self._num_synced[g].extend([0] * old)
                self._num_nulled[g].extend([0] * old)
            self._seen.extend([None] * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        return row


class BatchBuilder:
    """Builds ForwardBatch tensors on ``device`` from a SchedulerOutput."""

    def __init__(
        self,
        page_size: int,
        max_pages_per_seq: int,
        device: torch.device | str = "cpu",
        groups: list[str] | None = None,
    ) -> None:
        """``groups``: the KV pool groups, each with its page table (default: one, "full")."""
        self.page_size = page_size
        self.device = torch.device(device)
        self.rows = PageTableRows(groups or [FULL_GROUP], max_pages_per_seq)

    def release(self, request_ids: list[str]) -> None:
        """Forget the rows of requests that left the running set (``SchedulerOutput.released_ids``);
        call it before ``build`` of the same step, since a request may be readmitted with new pages."""
        for request_id in request_ids:
            self.rows.release(request_id)

    def build(self, out: SchedulerOutput) -> ForwardBatch:
        """The batch of ``out.requests``; each must already hold pages for its new tokens."""
        reqs = out.requests
        if not reqs:
            raise ValueError("cannot build a forward batch without requests")
        b = len(reqs)
        ps = self.page_size
        rows = np.fromiter((self.rows.row(r) for r in reqs), np.int64, b)
        query_lens = np.asarray(out.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, b)
        seq_lens = starts + query_lens
        cu_seqlens = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_seqlens[1:])
        num_tokens = int(cu_seqlens[-1])
        if num_tokens == b:  # one new token each (decode): no repeat/concat needed
            positions = starts
            token_rows = rows
            input_ids = np.fromiter(
                (r.all_token_ids[r.num_computed_tokens] for r in reqs), np.int64, b
            )
        else:
            # token t of sequence i sits at position starts[i] + (t - cu_seqlens[i])
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
                cu_seqlens[:-1] - starts, query_lens
            )
            token_rows = np.repeat(rows, query_lens)
            chunks = (
                r.all_token_ids[s : s + n]
                for r, s, n in zip(reqs, starts.tolist(), out.num_new_tokens, strict=True)
            )
            input_ids = np.fromiter(chain.from_iterable(chunks), np.int64, num_tokens)
        max_pages = -(-int(seq_lens.max()) // ps)
        page_index, offset = positions // ps, positions % ps
        slot_mappings, page_tables = {}, {}
        for g, table in self.rows.tables.items():
            slots = table[token_rows, page_index].astype(np.int64) * ps + offset
            slot_mappings[g] = self._tensor(slots)
            # fancy indexing copies: later row writes cannot leak in
            page_tables[g] = self._tensor(table[rows, :max_pages])
        logits_indices = cu_seqlens[1:][np.asarray(out.sample, dtype=bool)] - 1
        return ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            slot_mappings=slot_mappings,
            page_tables=page_tables,
            seq_lens=self._tensor(seq_lens.astype(np.int32)),
            cu_seqlens_q=self._tensor(cu_seqlens.astype(np.int32)),
            max_query_len=int(query_lens.max()),
            logits_indices=self._tensor(logits_indices),
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)
