"""Shared factories for transfer tests: tiny pool groups, a worker-like KV side with page accounting,
a transceiver config for real UCX over loopback (TCP on 127.0.0.1), and a sender/receiver pair
on either data path that this CPU machine runs ("ucx", "host_shm")."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvcache.manager import KVCacheManager
from kvcache.spec import PoolGroupSpec
from tests.transfer.raw_peer import RawPeer
from transfer import KVReceiver, KVSender, TransceiverConfig
from transfer.messages import PullRequest, Welcome
from transfer.paths import staging
from transfer.runtime import UcxRuntime

# One UCX context per process: every test of this package uses these settings.
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
MODEL = "tiny-test-model"
SECRET = "test-cluster-secret"
CPU_PATHS = ("ucx", "host_shm")
IN_PLACE = "ucx-in-place"  # the UCX path, its chunks runs of pages it moves in place


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


def config(path: str = "ucx", **overrides: Any) -> TransceiverConfig:
    """Short deadlines so failure tests end quickly; chunks of 8 tokens (2 pages) on the UCX path;
    ``path`` "host_shm" turns direct reads on (two CPU sides of one host take it)."""
    base: dict[str, Any] = dict(
        secret=SECRET,
        staging_tokens=8,
        staging_buffers=2,
        lease_s=10.0,
        connect_deadline_s=5.0,
        pull_deadline_s=5.0,
        chunk_deadline_s=3.0,
        done_deadline_s=3.0,
        ack_deadline_s=3.0,
        ucx_env=UCX_ENV,
        direct_copy=path != "ucx",
    )
    base.update(overrides)
    return TransceiverConfig(**base)


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

    def scramble_free_queue(self, ordered: bool = False) -> None:
        """Take every free page and give them back in random order, so later allocations get
        non-contiguous, unordered pages; ``ordered``: in page order, so they get consecutive
        ones."""
        with self.lock:
            n = min(self.kv.num_free_pages(g) for g in self.kv.buffers)
            for i in range(n):
                assert self.kv.allocate_slots(f"_scramble{i}", 1)
            first = next(iter(self.kv.buffers))
            # (A freed page without a hash goes to the queue's head: the last freed comes first.)
            by_page = sorted(
                range(n), key=lambda i: self.kv.page_ids(f"_scramble{i}")[first], reverse=True
            )
            for i in by_page if ordered else torch.randperm(n, generator=self.gen).tolist():
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


class Pair:
    """A sender and a receiver in this process, on the data path ``path``."""

    def __init__(self, path: str = "ucx", two_groups: bool = False, **cfg: Any) -> None:
        self.p = KVSide(specs(two_groups=two_groups), seed=1)
        self.d = KVSide(specs(two_groups=two_groups), seed=2)
        self.p.scramble_free_queue()
        self.d.scramble_free_queue()
        cfg_obj = config(path, **cfg)
        self.sender = KVSender(self.p.kv.buffers, self.p.specs, MODEL, cfg_obj, self.p.release)
        self.receiver = KVReceiver(self.d.kv.buffers, self.d.specs, MODEL, cfg_obj)

    def publish(self, rid: str, num_tokens: int, declared: int | None = None):  # noqa: ANN201
        pages = self.p.allocate(rid, num_tokens)
        return self.sender.publish(rid, pages, num_tokens if declared is None else declared), pages

    def pull(self, rid: str, tokens: int, expected: int | None = None):  # noqa: ANN201
        """Publish ``tokens`` tokens of ``rid`` and pull them into fresh pages of D."""
        ticket, src = self.publish(rid, tokens)
        dst = self.d.allocate(rid, tokens)
        result = self.receiver.pull_blocking(
            ticket, dst, 0, tokens if expected is None else expected
        )
        return result, src, dst

    def same(self, src: dict[str, list[int]], dst: dict[str, list[int]]) -> bool:
        got, want = self.d.pages_of(dst), self.p.pages_of(src)
        return all(torch.equal(got[g], want[g]) for g in src)

    def pull_ok(self, rid: str, tokens: int = 8) -> None:
        result, src, dst = self.pull(rid, tokens)
        assert result.ok, result.error
        assert self.same(src, dst)
        self.d.free(rid)
        wait_until(lambda: rid in self.p.released)

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@contextlib.contextmanager
def checked_pair(path: str = "ucx", two_groups: bool = False, **cfg: Any) -> Iterator[Pair]:
    """A Pair that is closed afterwards, and then must have every page back on both sides."""
    made = Pair(path, two_groups, **cfg)
    try:
        yield made
    finally:
        made.close()
    made.p.assert_clean()
    made.d.assert_clean()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture(scope="session", autouse=True)
def ucx_runtime() -> Iterator[UcxRuntime]:
    """Hold the process's UCX runtime for the whole session, so tests do not pay for starting and
    stopping UCX each time."""
    runtime = UcxRuntime.acquire(UCX_ENV, progress_mode=config().ucx_progress_mode(cuda=False))
    yield runtime
    runtime.release()


@pytest.fixture(params=(*CPU_PATHS, IN_PLACE))
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    """A checked pair on each data path this machine runs, and on the UCX path with every page
    large enough to go in place (its chunks are runs of pages, moved with no staging copy)."""
    path = request.param
    if path == IN_PLACE:
        monkeypatch.setattr(staging, "RUN_PAGE_BYTES", 0)
        path = "ucx"
    with checked_pair(path) as made:
        yield made


@contextlib.contextmanager
def joined_raw_peer(pair: Pair, ucx_runtime: UcxRuntime) -> Iterator[RawPeer]:
    """A raw decode side past the handshake with ``pair``'s sender (the cluster's secret)."""
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        answer = peer.handshake(
            SECRET.encode(), pair.receiver.page_table, ucx_runtime.worker_address
        )
        assert isinstance(answer, Welcome)
        yield peer
    finally:
        peer.close()


def staged_pull_request(pair: Pair, rid: str, pull_id: int, credits: list[int]) -> PullRequest:
    """A staged UCX pull of ``rid``'s published 8 tokens as one chunk, ``credits`` as given."""
    ticket, src = pair.publish(rid, 8)
    nbytes = pair.p.specs[0].page_bytes * len(src["full"])
    dst = {"full": list(range(1, 1 + len(src["full"])))}
    return PullRequest(rid, pull_id, ticket.lease_gen, src, dst, {"full": 0}, 8, [nbytes], nbytes, credits)  # fmt: skip
