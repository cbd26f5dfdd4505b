"""Pulls over UCX without staging copies: P writes D's pages itself (one-sided puts, csrc/ucp_rma.c).

    D: regions = RmaRegions.register(runtime, rows)    # once; Hello.rma = regions.to_wire()
    P: target = RmaTarget.open(runtime, endpoint, hello.rma, hello.page_table)   # per link
    P: batch = target.put(rows, plan)                  # every page run, then a flush
       ok, error = await batch.wait(timeout)           # the flush ended: the bytes are in D's pages

D registers its host pools with its UCX context and names them in Hello (base address, length and
packed remote key per pool). P unpacks the keys on that link's endpoint and serves a pull by writing
each page run of the plan from its pool straight into D's, then flushing the endpoint, whose
completion means every byte is in D's memory; only then does it send TransferDone. Nothing is
gathered or scattered, and over TCP a put is one stream write that D's worker receives straight into
the destination, where a tag message costs a rendezvous and the staged path two extra copies
(docs/benchmarks/transfer.md, eighth pass).

Host memory only. A pull D gives up on (its deadline) must not leave P writing into pages D then
frees: D aborts the link, and with host memory UCX moves the bytes over network transports (TCP, or
RDMA into a queue pair) that stop delivering once D's endpoint is closed; ucxx's abort returns only
after that close. GPU pools move by direct reads on one host; between hosts they keep the staged
path until a fence for GPU-initiated writes exists.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import numpy as np
import torch

from transfer.page_table import PageTable
from transfer.plan import TransferPlan

log = logging.getLogger(__name__)

NAME = "duet_ucp_rma"
SOURCE = Path(__file__).parent / "csrc" / "ucp_rma.c"


class RmaUnavailable(Exception):
    pass


@functools.lru_cache(maxsize=1)
def module() -> ModuleType | None:
    """The C extension, built against the UCX that ucxx loaded; None (logged once) when it cannot
    be had, and pulls then take the staged path."""
    if os.environ.get("DUET_UCX_RMA", "1") == "0":
        return None
    try:
        import libucx

        from kernels.native_build import build_and_load

        root = Path(libucx.__file__).parent
        include, lib = root / "include", root / "lib"
        if not (include / "ucp" / "api" / "ucp.h").exists():
            raise RmaUnavailable(f"no UCX headers under {include}")
        # Linked by soname against the libraries ucxx already loaded into the process.
        return build_and_load(
            NAME,
            SOURCE,
            cflags=[f"-I{include}"],
            ldflags=[f"-L{lib}", "-l:libucp.so.0", "-l:libucs.so.0", f"-Wl,-rpath,{lib}"],
        )
    except Exception as e:  # any failure leaves the staged path in place
        log.warning("one-sided UCX writes are not available (%s); using staged chunks", e)
        return None


@dataclass(frozen=True)
class Region:
    pool: str
    base: int
    length: int
    rkey: bytes  # packed remote key (D) / unused (P keeps the unpacked handle beside it)


class RmaRegions:
    """D's host pools, registered with its UCX context for peers to write into."""

    def __init__(self, context: int, mod: ModuleType, regions: list[Region], memhs: list[int]):
        self._context = context
        self._mod = mod
        self.regions = regions
        self._memhs = memhs

    @classmethod
    def register(cls, context: int, rows: Mapping[str, torch.Tensor]) -> RmaRegions:
        """Register every pool of ``rows`` (host memory) with the UCX context ``context``."""
        mod = module()
        if mod is None:
            raise RmaUnavailable("the C extension is not available")
        if any(r.device.type != "cpu" for r in rows.values()):
            raise RmaUnavailable("pools are not in host memory")
        regions: list[Region] = []
        memhs: list[int] = []
        try:
            for name, r in rows.items():
                base, length = r.data_ptr(), r.numel() * r.element_size()
                memh, packed = mod.map(context, base, length)
                memhs.append(memh)
                regions.append(Region(name, base, length, packed))
        except RuntimeError as e:
            for memh in memhs:
                mod.unmap(context, memh)
            raise RmaUnavailable(str(e)) from None
        return cls(context, mod, regions, memhs)

    def to_wire(self) -> bytes:
        return msgpack.packb(
            [[r.pool, r.base, r.length, r.rkey] for r in self.regions], use_bin_type=True
        )

    def close(self) -> None:
        """Unregister (before the UCX context goes; no peer may write afterwards)."""
        memhs, self._memhs = self._memhs, []
        for memh in memhs:
            try:
                self._mod.unmap(self._context, memh)
            except RuntimeError as e:
                log.warning("unregistering a pool failed: %s", e)


def regions_from_wire(data: bytes, peer: PageTable) -> list[Region]:
    """D's regions as sent in Hello, checked against D's page table: one per pool, each large
    enough for every page the table promises. Raises RmaUnavailable for anything else."""
    try:
        items = msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise RmaUnavailable(f"unreadable regions ({type(e).__name__})") from None
    if not isinstance(items, list):
        raise RmaUnavailable("regions are not a list")
    regions = {}
    for item in items:
        if not (
            isinstance(item, list)
            and len(item) == 4
            and isinstance(item[0], str)
            and all(type(v) is int and 0 <= v < 1 << 64 for v in item[1:3])
            and isinstance(item[3], bytes)
        ):
            raise RmaUnavailable(f"malformed region {str(item)[:60]}")
        regions[item[0]] = Region(*item)
    for pool in peer.pools:
        region = regions.get(pool.name)
        if region is None or region.length < pool.num_pages * pool.page_bytes:
            raise RmaUnavailable(f"no region for all of pool {pool.name!r}")
    if set(regions) != {p.name for p in peer.pools}:
        raise RmaUnavailable(f"regions {sorted(regions)} do not match the peer's pools")
    return list(regions.values())


class PutBatch:
    """One pull's puts and the flush after them."""

    def __init__(self, mod: ModuleType, handle: Any, nbytes: int, target: RmaTarget) -> None:
        self._mod = mod
        self._handle = handle
        self.nbytes = nbytes
        self._target = target

    @property
    def ended(self) -> bool:
        return self._mod.status(self._handle) is not None

    async def wait(self, timeout: float) -> tuple[bool, str] | None:
        """(ok, error) once the flush ended; None if it is still in flight after ``timeout`` (the
        caller must abort the link and wait again before the pages are reused)."""
        status = self._mod.status(self._handle)
        if status is None:
            loop = asyncio.get_running_loop()
            ended = loop.create_future()
            fd = self._mod.fileno(self._handle)
            loop.add_reader(fd, lambda: ended.done() or ended.set_result(None))
            try:
                await asyncio.wait_for(ended, timeout)
            except asyncio.TimeoutError:
                return None
            finally:
                loop.remove_reader(fd)
            status = self._mod.status(self._handle)
        self._target.batch_ended(self)
        ok, error, _posted = status
        return ok, error


class RmaTarget:
    """P's handle on one D's registered pools, for the link's endpoint."""

    def __init__(self, mod: ModuleType, worker: int, endpoint: int, regions: list[Region]):
        self._mod = mod
        self._worker = worker
        self._endpoint = endpoint
        self.rkeys: dict[str, tuple[int, int, int]] = {}  # pool -> (base, length, rkey)
        self._in_flight: set[PutBatch] = set()
        self._closed = False
        try:
            for r in regions:
                self.rkeys[r.pool] = (r.base, r.length, mod.unpack(endpoint, r.rkey))
        except RuntimeError as e:
            self._destroy()
            raise RmaUnavailable(str(e)) from None

    @classmethod
    def open(cls, worker: int, endpoint: int, wire: bytes, peer: PageTable) -> RmaTarget:
        mod = module()
        if mod is None:
            raise RmaUnavailable("the C extension is not available")
        return cls(mod, worker, endpoint, regions_from_wire(wire, peer))

    def ops(self, rows: Mapping[str, torch.Tensor], plan: TransferPlan) -> np.ndarray:
        """(local address, remote address, bytes, rkey) per page run of ``plan``, runs that are
        consecutive on both sides merged. Raises ValueError for a run outside D's region."""
        frags = [f for c in plan.chunks for f in c.fragments]
        out = np.empty((len(frags), 4), dtype=np.uint64)
        bases = {name: r.data_ptr() for name, r in rows.items()}
        for i, f in enumerate(frags):
            base, length, rkey = self.rkeys[f.dst_pool]
            if f.dst_offset + f.nbytes > length:
                raise ValueError(f"a run of {f.nbytes} bytes at {f.dst_offset} leaves {f.dst_pool}")
            out[i] = (bases[f.src_pool] + f.src_offset, base + f.dst_offset, f.nbytes, rkey)
        return merge_runs(out)

    def put(self, ops: np.ndarray) -> PutBatch:
        if self._closed:
            raise RmaUnavailable("the link is closed")
        handle = self._mod.put(self._worker, self._endpoint, np.ascontiguousarray(ops))
        batch = PutBatch(self._mod, handle, int(ops[:, 2].sum()) if len(ops) else 0, self)
        self._in_flight.add(batch)
        return batch

    def batch_ended(self, batch: PutBatch) -> None:
        self._in_flight.discard(batch)
        if self._closed and not self._in_flight:
            self._destroy()

    def close(self) -> None:
        """No more puts; the keys go once no batch is in flight (a batch UCX still runs keeps them,
        and its wait frees them)."""
        self._closed = True
        self._in_flight = {b for b in self._in_flight if not b.ended}
        if not self._in_flight:
            self._destroy()

    def _destroy(self) -> None:
        keys, self.rkeys = self.rkeys, {}
        for _base, _length, rkey in keys.values():
            self._mod.destroy(rkey)


def merge_runs(ops: np.ndarray) -> np.ndarray:
    """``ops`` with each op that continues the previous one on both sides (same key) folded into
    it: a contiguous request becomes one put, whatever the chunking."""
    if len(ops) < 2:
        return ops
    cont = (
        (ops[1:, 0] == ops[:-1, 0] + ops[:-1, 2])
        & (ops[1:, 1] == ops[:-1, 1] + ops[:-1, 2])
        & (ops[1:, 3] == ops[:-1, 3])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    merged = ops[starts].copy()
    merged[:, 2] = np.add.reduceat(ops[:, 2], starts)
    return merged
