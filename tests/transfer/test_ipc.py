"""Pool exports of the same-host data path (transfer/ipc.py) on the CPU: they round-trip and
reject garbage, host pools open read-only from the very files P exported (and refuse any other),
and pools made elsewhere move to /dev/shm when they fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import transfer.ipc
from tests.transfer.conftest import KVSide, specs
from transfer.ipc import IpcExport, IpcPool, IpcUnavailable, export_pools, unexport

pytestmark = pytest.mark.timeout(60)


def uint8_rows(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {g: b.view(-1).view(torch.uint8).view(b.shape[0], -1) for g, b in buffers.items()}


def test_pool_exports_round_trip_and_reject_garbage() -> None:
    rows = uint8_rows(KVSide(specs(), seed=4).kv.buffers)
    export = export_pools(rows, share=False)  # this process only: the registry, no files
    assert export.device == "cpu" and export.pools == ()
    assert IpcExport.from_wire(export.to_wire()) == export
    shared = export_pools(rows, share=True)  # host pools: their shared-memory files
    assert [p.name for p in shared.pools] == list(rows)
    assert IpcExport.from_wire(shared.to_wire()) == shared
    unexport(export)
    unexport(shared)
    pool = IpcPool("full", b"h", 1, 0, b"r", 0, 0, 1, 1)
    with_pool = dataclasses.replace(export, pools=(pool,))
    assert IpcExport.from_wire(with_pool.to_wire()) == with_pool
    for garbage in (b"", b"\xc1", b"\x93\x01\x02\x03", with_pool.to_wire()[:-3]):
        with pytest.raises(IpcUnavailable, match="malformed pool export"):
            IpcExport.from_wire(garbage)
    wrong_type = dataclasses.replace(with_pool, pools=(dataclasses.replace(pool, nbytes="1"),))
    with pytest.raises(IpcUnavailable, match="nbytes"):
        IpcExport.from_wire(wrong_type.to_wire())


def test_host_pools_open_read_only_from_the_very_files_p_exported() -> None:
    side = KVSide(specs(), seed=5)
    rows = uint8_rows(side.kv.buffers)
    before = rows["full"].data_ptr()
    export = export_pools(rows, share=True)
    try:
        assert rows["full"].data_ptr() == before  # kvcache's pools are memfd files: no move
        opened = transfer.ipc._open_host_pools(export)  # as another process of this host would
        assert torch.equal(opened["full"], rows["full"])
        rows["full"][3].fill_(7)  # one memory: a write by P is what D reads
        assert bool((opened["full"][3] == 7).all())
        pool = export.pools[0]
        fd, dev, ino, ns = pool.handle.split(b":")
        for bad in (
            dataclasses.replace(pool, handle=b"x"),  # malformed
            dataclasses.replace(pool, handle=b"99999:%s:%s:%s" % (dev, ino, ns)),  # no such fd
            dataclasses.replace(pool, handle=b"%s:%s:%d:%s" % (fd, dev, int(ino) + 1, ns)),
            dataclasses.replace(pool, handle=b"%s:%s:%s:%d" % (fd, dev, ino, int(ns) + 1)),
            dataclasses.replace(pool, storage_bytes=pool.storage_bytes * 2),  # not that file
            dataclasses.replace(pool, nbytes=pool.storage_bytes + pool.page_bytes),  # past it
            dataclasses.replace(pool, page_bytes=0),
        ):
            with pytest.raises(IpcUnavailable):
                transfer.ipc._open_host_pools(dataclasses.replace(export, pools=(bad,)))
        assert torch.equal(opened["full"], rows["full"])  # nothing above grew or wrote the file
    finally:
        unexport(export)


def test_other_host_pools_move_to_dev_shm_when_they_fit(monkeypatch) -> None:
    spec = specs()[0]
    rows = uint8_rows({"full": torch.zeros(spec.buffer_shape, dtype=spec.dtype)})
    monkeypatch.setattr(transfer.ipc, "_shm_free_bytes", lambda: 1 << 20)
    with pytest.raises(IpcUnavailable, match="do not fit"):
        export_pools(rows, share=True)
    monkeypatch.setattr(transfer.ipc, "_shm_free_bytes", lambda: 1 << 40)  # whatever the host has
    rows["full"][2].fill_(5)
    export = export_pools(rows, share=True)  # moved in place: the tensor keeps its bytes
    try:
        assert rows["full"].is_shared() and bool((rows["full"][2] == 5).all())
        assert torch.equal(transfer.ipc._open_host_pools(export)["full"], rows["full"])
    finally:
        unexport(export)
