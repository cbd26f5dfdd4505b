"""GPU pool exports (transfer/ipc.py) opened by another process: they open and read P's bytes, and
an export that claims more memory than its CUDA IPC handle maps is refused when opened (the link
then stays on UCX) instead of letting a copy kernel fault past the mapping."""

from __future__ import annotations

import dataclasses
import multiprocessing
from multiprocessing.connection import Connection

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

PAGES, PAGE_BYTES = 64, 32 << 10


def exporter(conn: Connection) -> None:
    from transfer.ipc import export_pools

    rows = torch.arange(PAGES * PAGE_BYTES, device="cuda:0").to(torch.uint8).view(PAGES, -1)
    export = export_pools({"full": rows}, share=True)
    conn.send(export.to_wire())
    conn.recv()  # the pools stay exported until the test is done with them


def test_an_export_claiming_more_than_its_handle_maps_is_refused() -> None:
    from transfer.ipc import IpcExport, IpcUnavailable, open_pools

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=exporter, args=(child,), daemon=True)
    proc.start()
    try:
        assert conn.poll(120), "the exporting process did not start"
        export = IpcExport.from_wire(conn.recv())
        own_device = f"cuda:{torch.cuda.device_count() - 1}"
        own = {"full": torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8, device=own_device)}
        path, rows = open_pools(export, own)
        assert path == "cuda_ipc"
        want = torch.arange(PAGES * PAGE_BYTES).to(torch.uint8).view(PAGES, -1)
        assert torch.equal(rows["full"].cpu(), want)
        del rows
        pool = export.pools[0]
        inflated = dataclasses.replace(
            pool,
            storage_bytes=pool.storage_bytes + (1 << 34),
            nbytes=pool.nbytes + (1 << 34),
        )
        with pytest.raises(IpcUnavailable, match="does not lie in the allocation"):
            open_pools(dataclasses.replace(export, pools=(inflated,)), own)
    finally:
        conn.send("done")
        proc.join(30)
