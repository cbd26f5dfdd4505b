"""Shared factories for transfer tests: tiny pool groups, a worker-like KV side with page accounting,
and a transceiver config for real UCX over loopback (TCP on 127.0.0.1)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvcache.manager import KVCacheManager
from kvcache.spec import PoolGroupSpec
from transfer.config import TransceiverConfig
from transfer.runtime import UcxRuntime

# One UCX context per process: every test of this package uses these settings.
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
MODEL = "tiny-test-model"


def specs(
    num_pages: int = 256,
    page_size: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    two_groups: bool = False,
) -> list[PoolGroupSpec]:
    """One "full" group of 3 layers (and optionally a second group with other roles)."""
    out = [PoolGroupSpec("full", (0, 1, 2), num_pages, page_size, heads, head_dim, dtype)]
    if two_groups:
        out.append(
            PoolGroupSpec(
                "extra",
                (3,),
                num_pages,
                page_size,
                heads,
                head_dim,
                dtype,
                pool_role=frozenset({"key_extra", "value_extra"}),
            )
        )
    return out


def config(**overrides: object) -> TransceiverConfig:
    """Short deadlines so failure tests end quickly; chunks of 8 tokens (2 pages) by default, also
    where both sides list host pages (``piece_chunk_tokens``: many chunks in flight; the larger
    piece chunks have tests of their own in test_host_iov.py)."""
    base: dict[str, object] = dict(
        staging_tokens=8,
        piece_chunk_tokens=8,
        staging_buffers=2,
        lease_s=10.0,
        connect_deadline_s=5.0,
        pull_deadline_s=5.0,
        chunk_deadline_s=3.0,
        done_deadline_s=3.0,
        ack_deadline_s=3.0,
        ucx_env=UCX_ENV,
        # The UCX data path: most tests here run both sides in one process, which would otherwise
        # take the direct-read path (tests/transfer/test_direct_read.py covers that one).
        direct_copy=False,
    )
    base.update(overrides)
    return TransceiverConfig(**base)  # type: ignore[arg-type]


class KVSide:
    """One worker's KV cache for transfer tests. The release callback runs on the transceiver's
    thread, so every cache call goes through a lock (the worker's step loop plays that role)."""

    def __init__(self, group_specs: list[PoolGroupSpec], seed: int) -> None:
        self.specs = group_specs
        self.kv = KVCacheManager(group_specs, "none", "cpu")
        self.lock = threading.Lock()
        self.released: list[str] = []
        self.gen = torch.Generator().manual_seed(seed)
        for buf in self.kv.buffers.values():  # nothing starts out equal by accident
            buf.copy_(torch.randn(buf.shape, generator=self.gen))
        self.initial_free = self.free_pages()

    def free_pages(self) -> dict[str, int]:
        with self.lock:
            return {g: self.kv.num_free_pages(g) for g in self.kv.buffers}

    def allocate(self, request_id: str, num_tokens: int) -> dict[str, list[int]]:
        """Pages for ``num_tokens`` tokens, filled with fresh random values."""
        with self.lock:
            assert self.kv.allocate_slots(request_id, num_tokens)
            pages = self.kv.page_ids(request_id)
        for g, ids in pages.items():
            buf = self.kv.buffers[g]
            buf[ids] = torch.randn((len(ids), *buf.shape[1:]), generator=self.gen)
        return pages

    def scramble_free_queue(self) -> None:
        """Take every free page one by one and give them back in random order, so later
        allocations get non-contiguous, unordered pages."""
        with self.lock:
            n = min(self.kv.num_free_pages(g) for g in self.kv.buffers)
            for i in range(n):
                assert self.kv.allocate_slots(f"_scramble{i}", 1)
            for i in torch.randperm(n, generator=self.gen).tolist():
                self.kv.free(f"_scramble{i}")

    def release(self, request_id: str) -> None:
        with self.lock:
            self.kv.free(request_id)
            self.released.append(request_id)

    def free(self, request_id: str) -> None:
        with self.lock:
            self.kv.free(request_id)

    def pages_of(self, pages: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        return {g: self.kv.buffers[g][ids].clone() for g, ids in pages.items()}

    def assert_clean(self) -> None:
        with self.lock:
            self.kv.check_integrity()
        assert self.free_pages() == self.initial_free


@pytest.fixture(scope="session", autouse=True)
def ucx_runtime() -> Iterator[UcxRuntime]:
    """Hold the process's UCX runtime for the whole session, so tests do not pay for starting and
    stopping UCX each time (test_runtime.py checks the shutdown in a fresh process)."""
    runtime = UcxRuntime.acquire(UCX_ENV)
    yield runtime
    runtime.release()
