"""The cuda_ipc path: GPUs of one host (or two processes on one GPU), D reading P's pools.

P exports each pool's CUDA IPC handle once (torch's ``_share_cuda_``); D opens the handles once
per link in its own GPU's context, and reads a pull's pages with the Triton page-copy kernel
(duet_kernels.copy_pages) launched on D's GPU on a side stream ordered after D's model stream, the
ids on D's GPU, P's memory read over NVLink. D waits for the copy on a helper thread, within the
read's deadline (paths/direct.py); a copy past it is fenced: D's model stream waits for it before
anything else may touch those pages, and the pull fails.

GPU workers of a disaggregated cluster see all of the node's GPUs (cluster/builder.py), which
opening a peer GPU's handle needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from transfer.mapper import Segment
from transfer.paths.base import PoolsUnavailable, PullFailed
from transfer.paths.direct import DirectPath, SegmentIds, copy_segments
from transfer.pools import segment_ids

if TYPE_CHECKING:
    from transfer.pull import PullSession

log = logging.getLogger(__name__)


class CudaIpcPath(DirectPath):
    name = "cuda_ipc"

    def __init__(
        self, peer_rows: dict[str, torch.Tensor] | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__(peer_rows)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device is not None else None

    def prepare(self, segments: Sequence[Segment]) -> SegmentIds:
        # The ids go up on the copy stream while the request travels: about 0.3 ms of host time
        # (one H200, bench_transfer.py --timeline) off the read's critical path. Queued before
        # the stream waits for the model's, they wait for nothing.
        assert self.device is not None and self.stream is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return [segment_ids(seg, self.device) for seg in segments]

    async def copy(
        self,
        pull: PullSession,
        segments: Sequence[Segment],
        deadline: float,
        ids: SegmentIds | None = None,
    ) -> None:
        assert self.peer_rows is not None and self.device is not None and self.stream is not None
        model_stream = torch.cuda.default_stream(self.device)
        with torch.cuda.device(self.device):
            self.stream.wait_stream(model_stream)
            with torch.cuda.stream(self.stream):
                copy_segments(segments, self.peer_rows, pull.r.rows, self.device, ids)
            done = torch.cuda.Event()
            done.record(self.stream)
        loop = asyncio.get_running_loop()
        finished = loop.run_in_executor(None, done.synchronize)
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await asyncio.shield(finished)
        except TimeoutError:
            model_stream.wait_event(done)
            log.error(
                "a page copy of %s outlived its pull: the model's stream waits for it",
                pull.ticket.request_id,
            )
            raise PullFailed("the page copy did not end within the read's deadline") from None

    def close(self) -> None:
        self.peer_rows = None


def export_pools(rows: Mapping[str, torch.Tensor]) -> list[Any]:
    """[P's GPU's UUID, one entry per pool with its CUDA IPC handle]."""
    first = next(iter(rows.values()))
    pools = []
    for name, r in rows.items():
        storage = r.untyped_storage()
        try:
            # The IPC event torch also returns orders a consumer after the producer's pending
            # writes: P publishes a lease only after its device work on the pages has ended.
            _, handle, size, offset, rc_handle, rc_offset, _event, _sync = storage._share_cuda_()
        except Exception as e:
            raise PoolsUnavailable(f"cannot export pool {name!r}: {e}") from None
        byte_offset = r.storage_offset() * r.element_size()
        pools.append(
            [name, bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
             byte_offset, r.numel(), r.shape[1]]
        )  # fmt: skip
    return [str(torch.cuda.get_device_properties(first.device).uuid), pools]


def open_pools(export: Any, own: torch.device) -> dict[str, torch.Tensor]:
    """P's pools opened in our GPU's context, as [num_pages, page_bytes] uint8 rows."""
    uuid, pools = export
    peer = _visible_index(uuid)
    local = own.index if own.index is not None else torch.cuda.current_device()
    if peer != local and not torch.cuda.can_device_access_peer(local, peer):
        raise PoolsUnavailable(f"GPU {local} cannot access peer GPU {peer}")
    rows = {}
    with torch.cuda.device(local):
        for (
            name,
            handle,
            size,
            offset,
            rc_handle,
            rc_offset,
            byte_offset,
            nbytes,
            page_bytes,
        ) in pools:
            try:
                # The tensor is labelled cuda:<local> but addresses P's memory: what a kernel
                # launched here needs.
                storage = torch.UntypedStorage._new_shared_cuda(
                    local, handle, size, offset, rc_handle, rc_offset, b"", False
                )
            except Exception as e:
                raise PoolsUnavailable(f"cannot open pool {name!r}: {e}") from None
            if page_bytes <= 0 or nbytes % page_bytes or byte_offset + nbytes > storage.nbytes():
                raise PoolsUnavailable(f"pool {name!r}: its rows do not lie in its storage")
            device = torch.device("cuda", local)
            flat = torch.empty(0, dtype=torch.uint8, device=device)
            flat.set_(storage, byte_offset, (nbytes,))
            rows[name] = flat.view(-1, page_bytes)
    return rows


def _visible_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise PoolsUnavailable(f"the peer's GPU {uuid} is not visible to this process")
