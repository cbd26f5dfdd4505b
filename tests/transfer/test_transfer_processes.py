"""Two OS processes over real UCX on 127.0.0.1: byte-exact transfers into other pages, chunking,
50 concurrent pulls, and a peer killed in the middle of a transfer (on either side)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.transfer.conftest import MODEL, KVSide, config, specs
from tests.transfer.peer_process import run_decode, run_prefill
from tests.transfer.test_transfer_local import wait_until
from transfer import KVReceiver, KVSender, TransferResult

pytestmark = pytest.mark.timeout(90)

# Large pages (48 KiB) so a killed peer's transfer is still running when the kill lands.
BIG = dict(num_pages=1100, page_size=16, heads=4, head_dim=64)
BIG_CFG = dict(staging_tokens=64)


class Peer:
    """A spawned worker process and the pipe that drives it."""

    def __init__(
        self, target: Callable[..., None], seed: int, spec_kwargs: dict, cfg_kwargs: dict
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=target, args=(child, seed, spec_kwargs, cfg_kwargs), daemon=True
        )
        self.proc.start()
        assert self.conn.poll(60), "peer process did not start"
        _, self.port = self.conn.recv()

    def ask(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)  # only the process this test started
        self.proc.join(10)

    def close(self) -> dict:
        state = self.ask("close")
        self.proc.join(10)
        return state


def as_tensor(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).view(like.shape)


@pytest.fixture(scope="module")
def prefill_peer() -> Iterator[Peer]:
    peer = Peer(run_prefill, 11, {}, {})
    yield peer
    state = peer.close()
    assert state["free"] == state["initial_free"]  # every published request was released


@pytest.fixture
def decode_side() -> Iterator[tuple[KVSide, KVReceiver]]:
    side = KVSide(specs(), seed=12)
    side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, MODEL, config())
    yield side, receiver
    receiver.close()
    side.assert_clean()


def pull_and_check(
    peer: Peer, side: KVSide, receiver: KVReceiver, rid: str, num_tokens: int
) -> TransferResult:
    ticket, sent = peer.ask("publish", rid, num_tokens)
    dst = side.allocate(rid, num_tokens)
    assert dst != ticket.page_ids
    result = receiver.pull_blocking(ticket, dst, 0, num_tokens)
    assert result.ok, result.error
    got = side.pages_of(dst)["full"]
    assert torch.equal(got, as_tensor(sent["full"], got))
    side.free(rid)
    return result


def test_random_kv_in_scattered_pages_arrives_byte_exact(prefill_peer: Peer, decode_side) -> None:
    side, receiver = decode_side
    result = pull_and_check(prefill_peer, side, receiver, "x1", 6)  # 2 pages, one chunk
    assert result.stats.chunks == 1


def test_request_larger_than_the_staging_buffer_goes_in_chunks(
    prefill_peer: Peer, decode_side
) -> None:
    side, receiver = decode_side
    result = pull_and_check(prefill_peer, side, receiver, "x2", 200)  # 50 pages, 2 per chunk
    assert result.stats.chunks == 25
    wait_until(lambda: {"x1", "x2"} <= set(prefill_peer.ask("state")["released"]))
    assert prefill_peer.ask("state")["stats"]["expired_leases"] == 0  # acks freed them


def concurrent_pulls(
    peer: Peer, side: KVSide, receiver: KVReceiver, prefix: str, count: int
) -> dict[str, TransferResult]:
    """``count`` requests of 4 to 28 tokens published by ``peer``, pulled all at once from as
    many threads; every one must arrive exact in its own pages (then freed). Returns the results."""
    sizes = {f"{prefix}{i}": 4 + 4 * (i % 7) for i in range(count)}
    published = {rid: peer.ask("publish", rid, n) for rid, n in sizes.items()}
    dsts = {rid: side.allocate(rid, n) for rid, n in sizes.items()}
    results: dict[str, TransferResult] = {}

    def run(rid: str) -> None:
        results[rid] = receiver.pull_blocking(published[rid][0], dsts[rid], 0, sizes[rid])

    threads = [threading.Thread(target=run, args=(rid,)) for rid in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == count
    assert all(r.ok for r in results.values()), [r.error for r in results.values() if not r.ok]
    for rid, (_, sent) in published.items():
        for group, got in side.pages_of(dsts[rid]).items():
            assert torch.equal(got, as_tensor(sent[group], got)), (rid, group)
        side.free(rid)
    return results


def test_fifty_concurrent_transfers_between_processes(prefill_peer: Peer, decode_side) -> None:
    side, receiver = decode_side
    results = concurrent_pulls(prefill_peer, side, receiver, "y", 50)
    wait_until(lambda: set(results) <= set(prefill_peer.ask("state")["released"]))


@pytest.mark.parametrize("d_pages", ["one run", "scattered"])
def test_prefill_process_killed_mid_transfer(
    prefill_peer: Peer, d_pages: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Scattered pages of D are received as piece lists (transfer/ucp_iov.py): UCP receives
    that closing the endpoint would not end; the link's abort must."""
    side = KVSide(specs(**BIG), seed=13)
    if d_pages == "scattered":
        side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, MODEL, config(**BIG_CFG))
    victim = Peer(run_prefill, 14, BIG, BIG_CFG)
    try:
        ticket, _ = victim.ask("publish", "doomed", 1024 * 16)  # 1024 pages of 48 KiB, 256 chunks
        dst = side.allocate("doomed", 1024 * 16)
        out: list[TransferResult] = []
        thread = threading.Thread(
            target=lambda: out.append(receiver.pull_blocking(ticket, dst, 0, 1024 * 16))
        )
        thread.start()
        wait_until(lambda: receiver.stats()["chunks"] >= 1)
        victim.kill()
        thread.join(config().chunk_deadline_s + 10)
        assert out and not out[0].ok
        assert "link to the prefill worker closed" in out[0].error or "failed" in out[0].error
        assert "did not end" not in caplog.text  # every posted receive ended with the link
        side.free("doomed")  # safe: pull() returned only after every receive ended
    finally:
        receiver.close()
    side.assert_clean()
    small_side = KVSide(specs(), seed=15)
    small_receiver = KVReceiver(small_side.kv.buffers, small_side.specs, MODEL, config())
    try:
        pull_and_check(prefill_peer, small_side, small_receiver, "after-kill", 12)
    finally:
        small_receiver.close()
    small_side.assert_clean()


def test_decode_process_killed_mid_transfer_gives_p_its_pages_back() -> None:
    side = KVSide(specs(**BIG), seed=16)
    side.scramble_free_queue()
    sender = KVSender(side.kv.buffers, side.specs, MODEL, config(**BIG_CFG), side.release)
    victim = Peer(run_decode, 17, BIG, BIG_CFG)
    try:
        ticket = sender.publish("orphan", side.allocate("orphan", 1024 * 16), 1024 * 16)
        assert victim.ask("pull", ticket) == "started"
        wait_until(lambda: sender.stats()["chunks"] >= 1)
        victim.kill()
        wait_until(lambda: side.released == ["orphan"], timeout=config().chunk_deadline_s + 10)
        # P releases the pages before it records the failure (serve.py): wait for both.
        wait_until(lambda: sender.stats()["failures"] == 1)
        # The next transfer succeeds (a new decode side in this process).
        d = KVSide(specs(**BIG), seed=18)
        receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, config(**BIG_CFG))
        try:
            ticket = sender.publish("next", side.allocate("next", 64), 64)
            dst = d.allocate("next", 64)
            assert receiver.pull_blocking(ticket, dst, 0, 64).ok
            assert torch.equal(d.pages_of(dst)["full"], side.pages_of(ticket.page_ids)["full"])
            d.free("next")
            wait_until(lambda: "next" in side.released)
        finally:
            receiver.close()
        d.assert_clean()
    finally:
        sender.close()
    side.assert_clean()
