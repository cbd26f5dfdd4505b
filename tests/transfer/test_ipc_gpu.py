"""GPU pool exports (transfer/ipc.py) opened by another process: they open and read P's bytes, also
from torch's expandable segments (one mapping per segment), and an export that claims more memory
than its CUDA IPC handle maps is refused when opened (the link then stays on UCX) instead of
letting a copy kernel fault past the mapping."""

from __future__ import annotations

import dataclasses
import multiprocessing
from multiprocessing.connection import Connection

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]

PAGE_BYTES = 1 << 20


def exporter(conn: Connection, pages: int) -> None:
    from transfer.ipc import export_pools

    torch.zeros(3 << 20, dtype=torch.uint8, device="cuda:0")  # the pool is not the first block
    rows = torch.arange(pages * PAGE_BYTES, device="cuda:0").to(torch.uint8).view(pages, -1)
    conn.send(export_pools({"full": rows}, share=True).to_wire())
    conn.recv()  # the pools stay exported until the test is done with them


def opener(conn: Connection, wire: bytes, inflate: int) -> None:
    from transfer.ipc import IpcExport, IpcUnavailable, open_pools

    export = IpcExport.from_wire(wire)
    pool = export.pools[0]
    claimed = dataclasses.replace(
        pool, storage_bytes=pool.storage_bytes + inflate, nbytes=pool.nbytes + inflate
    )
    export = dataclasses.replace(export, pools=(claimed,))
    device = f"cuda:{torch.cuda.device_count() - 1}"  # the other GPU when there are two
    own = {"full": torch.zeros(4, PAGE_BYTES, dtype=torch.uint8, device=device)}
    try:
        path, rows = open_pools(export, own)
    except IpcUnavailable as e:
        conn.send(("refused", str(e)))
        return
    got = rows["full"][: pool.nbytes // PAGE_BYTES].cpu()
    want = torch.arange(got.numel()).to(torch.uint8).view(got.shape)
    conn.send((path, bool(torch.equal(got, want))))


def run(target, *args) -> tuple:
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    assert conn.poll(150), f"{target.__name__} did not answer"
    return proc, conn, conn.recv()


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable_segments"])
def test_exports_open_exact_and_one_claiming_more_than_its_mapping_is_refused(
    expandable: bool, monkeypatch
) -> None:
    if expandable:  # both processes, as a deployment would set it
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    exp, exp_conn, wire = run(exporter, 64)  # 64 MiB: several expandable segments
    try:
        for inflate, want in ((0, ("cuda_ipc", True)), (1 << 34, "refused")):
            proc, _, answer = run(opener, wire, inflate)
            proc.join(60)
            if want == "refused":
                assert answer[0] == "refused" and "does not lie in" in answer[1], answer
            else:
                assert answer == want, answer
    finally:
        exp_conn.send("done")
        exp.join(30)
