"""TransceiverSide: what both ends of the transfer build from a worker's pools (page table,
instance id, page rows, chunk size, statistics, the process's UCX runtime). KVSender and
KVReceiver add their role on top."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

import torch

from kvcache.spec import PoolGroupSpec
from transfer.config import TransceiverConfig, resolve_progress_mode
from transfer.page_table import PageTable
from transfer.plan import DIRECT_MAX_BYTES, Chunk, chunk_bytes_for
from transfer.runtime import UcxRuntime, cuda_index
from transfer.staging import StagingBuffers, pool_rows
from transfer.stats import StatsBook, TransferStats
from transfer.ucp_iov import IovOps


class TransceiverSide:
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
    ) -> None:
        """``buffers``: the KV storage per pool group (KVCacheManager.buffers); ``specs``: the pool
        groups, in order; ``model``: identity for the compatibility hash (peers must agree).
        Acquires the process's UCX runtime: a subclass that fails later must release it."""
        self.config = config
        self.page_table = PageTable.from_specs(model, specs)
        self.instance_id = uuid.uuid4().hex
        self.rows = pool_rows(buffers, {s.name: s.page_bytes for s in specs})
        self.chunk_bytes = chunk_bytes_for(self.page_table, config.staging_tokens)
        self.book = StatsBook(config.max_stats_len)
        self.device = next(iter(buffers.values())).device
        self.rows_on_gpu = self.device.type == "cuda"
        gpu = cuda_index(buffers)
        self._closing = False  # (``_begin_close``)
        self.runtime = UcxRuntime.acquire(
            config.ucx_env,
            gpu,
            resolve_progress_mode(config.progress_mode, gpu is not None, config.direct_copy),
        )
        # Our UCP messages for host pages (``host_iov``): scattered ones as piece lists, runs as
        # plain bytes; or None: stage scattered pages, and send runs through ucxx. (Made here, on
        # the caller's thread: the first one may build its C callbacks.)
        self.iov: IovOps | None = None
        if not self.rows_on_gpu and config.zero_copy and config.host_iov:
            self.iov = self.runtime.iov
        # The chunk size this side takes on links where both sides list host pages (Hello and
        # HelloReply ``piece_chunk_bytes``), or 0. Listing from a link's first chunk needs the
        # primer (primer.py), whose size is UCX's rendezvous threshold: unknown, no piece chunks.
        self.piece_chunk_bytes = 0
        if self.iov is not None and self.runtime.rendezvous_bytes is not None:
            tokens = max(config.piece_chunk_tokens, config.staging_tokens)
            self.piece_chunk_bytes = min(DIRECT_MAX_BYTES, chunk_bytes_for(self.page_table, tokens))

    def moves_straight(self, chunk: Chunk, source: bool) -> bool:
        """Whether this side moves ``chunk`` without its staging copy: its pages of it are one
        run (``Chunk.sends_straight`` / ``receives_straight``), or they are host memory that goes
        as a piece list (``iov``)."""
        one_run = (chunk.sends_straight if source else chunk.receives_straight)(
            self.config.zero_copy, self.chunk_bytes
        )
        return one_run or self.iov is not None

    def _begin_close(self) -> bool:
        """True the first time only: a second ``close`` does nothing (the runtime counts one
        release per side: two would stop it under another side of this process)."""
        if self._closing:
            return False
        self._closing = True
        return True

    def _make_staging(self) -> StagingBuffers:
        """On the loop thread (the buffers' queue belongs to it)."""
        return StagingBuffers(self.device, self.chunk_bytes, self.config.staging_buffers)

    def drain_transfer_stats(self) -> list[TransferStats]:
        return self.book.drain()
