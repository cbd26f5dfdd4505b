"""Two OS processes on each data path this CPU machine runs (UCX over TCP loopback, and shared
memory): byte-exact scattered pages, chunks, 50 concurrent pulls, and a peer killed in the middle
of a transfer on either side, after which the survivor has its pages back and serves on."""

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

from tests.transfer.conftest import CPU_PATHS, MODEL, KVSide, config, specs, wait_until
from tests.transfer.peer_process import run_decode, run_prefill
from transfer import KVReceiver, KVSender, TransferResult

pytestmark = pytest.mark.timeout(120)

# Large pages (48 KiB) so a killed peer's transfer is still running when the kill lands.
BIG = dict(num_pages=1100, page_size=16, heads=4, head_dim=64)
BIG_CFG = dict(staging_tokens=64)


class Peer:
    """A spawned worker process and the pipe that drives it."""

    def __init__(
        self, target: Callable[..., None], seed: int, spec_kwargs: dict, path: str, cfg: dict
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=target, args=(child, seed, spec_kwargs, path, cfg), daemon=True
        )
        self.proc.start()
        assert self.conn.poll(60), "peer process did not start"
        _, self.port = self.conn.recv()

    def ask(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def released_all(self) -> bool:
        state = self.ask("state")
        return state["free"] == state["initial_free"]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)  # only the process this test started
        self.proc.join(10)

    def close(self) -> dict:
        state = self.ask("close")
        self.proc.join(10)
        return state


def as_tensor(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).view(like.shape)


@pytest.fixture(scope="module", params=CPU_PATHS)
def prefill_peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    peer = Peer(run_prefill, 11, {"two_groups": True}, request.param, {})
    peer.path = request.param
    yield peer
    state = peer.close()
    assert state["free"] == state["initial_free"]  # every published request was released


@pytest.fixture
def decode_side(prefill_peer: Peer) -> Iterator[tuple[KVSide, KVReceiver]]:
    side = KVSide(specs(two_groups=True), seed=12)
    side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, MODEL, config(prefill_peer.path))
    yield side, receiver
    receiver.close()
    side.assert_clean()


def pull_and_check(
    peer: Peer, side: KVSide, receiver: KVReceiver, rid: str, n: int
) -> TransferResult:
    ticket, sent = peer.ask("publish", rid, n)
    dst = side.allocate(rid, n)
    assert dst != ticket.page_ids
    result = receiver.pull_blocking(ticket, dst, 0, n)
    assert result.ok, result.error
    assert result.stats.path == peer.path
    for group, got in side.pages_of(dst).items():
        assert torch.equal(got, as_tensor(sent[group], got)), group
    side.free(rid)
    return result


def test_scattered_pages_arrive_byte_exact_in_chunks(prefill_peer: Peer, decode_side) -> None:
    side, receiver = decode_side
    assert pull_and_check(prefill_peer, side, receiver, "x1", 6).ok  # 2 pages a group
    result = pull_and_check(prefill_peer, side, receiver, "x2", 200)  # 50 pages a group
    # Over UCX, 4 KiB chunks: 25 of two 1.5 KiB pages of "full" (2 "extra" pages of 512 bytes
    # fill the last one's room), then 6 of eight "extra" pages. One copy on a direct path.
    assert result.stats.chunks == (31 if prefill_peer.path == "ucx" else 1)
    wait_until(prefill_peer.released_all)
    assert prefill_peer.ask("state")["stats"]["expired_leases"] == 0  # notices freed them


def test_fifty_concurrent_pulls_between_processes(prefill_peer: Peer, decode_side) -> None:
    side, receiver = decode_side
    sizes = {f"y{i}": 4 + 4 * (i % 7) for i in range(50)}
    published = {rid: prefill_peer.ask("publish", rid, n) for rid, n in sizes.items()}
    dsts = {rid: side.allocate(rid, n) for rid, n in sizes.items()}
    results: dict[str, TransferResult] = {}

    def run(rid: str) -> None:
        results[rid] = receiver.pull_blocking(published[rid][0], dsts[rid], 0, sizes[rid])

    threads = [threading.Thread(target=run, args=(rid,)) for rid in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r.ok for r in results.values()), [r.error for r in results.values() if not r.ok]
    for rid, (_, sent) in published.items():
        for group, got in side.pages_of(dsts[rid]).items():
            assert torch.equal(got, as_tensor(sent[group], got)), (rid, group)
        side.free(rid)
    wait_until(prefill_peer.released_all)


@pytest.mark.parametrize("path", CPU_PATHS)
def test_prefill_process_killed_mid_transfer(path: str) -> None:
    side = KVSide(specs(**BIG), seed=13)
    side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, MODEL, config(path, **BIG_CFG))
    victim = Peer(run_prefill, 14, BIG, path, BIG_CFG)
    try:
        ticket, sent = victim.ask("publish", "doomed", 1024 * 16)  # 1024 pages of 48 KiB
        dst = side.allocate("doomed", 1024 * 16)
        out: list[TransferResult] = []
        thread = threading.Thread(
            target=lambda: out.append(receiver.pull_blocking(ticket, dst, 0, 1024 * 16))
        )
        thread.start()
        wait_until(lambda: receiver.sessions or out)  # the pull is under way (or done already)
        victim.kill()
        thread.join(config().pull_deadline_s + config().chunk_deadline_s + 10)
        assert out, "the pull did not end"
        if out[0].ok:  # a direct read may finish from P's shared memory first: then it is exact
            assert path == "host_shm"
            got = side.pages_of(dst)["full"]
            assert torch.equal(got, as_tensor(sent["full"], got))
        else:
            assert out[0].error
        side.free("doomed")  # safe: pull() returned only after every receive and copy ended
        survivor = Peer(run_prefill, 15, BIG, path, BIG_CFG)
        try:
            ticket, sent = survivor.ask("publish", "next", 64)
            dst = side.allocate("next", 64)
            result = receiver.pull_blocking(ticket, dst, 0, 64)
            assert result.ok, result.error
            got = side.pages_of(dst)["full"]
            assert torch.equal(got, as_tensor(sent["full"], got))
            side.free("next")
        finally:
            survivor.close()
    finally:
        receiver.close()
    side.assert_clean()


@pytest.mark.parametrize("path", CPU_PATHS)
def test_decode_process_killed_mid_transfer_gives_p_its_pages_back(path: str) -> None:
    side = KVSide(specs(**BIG), seed=16)
    side.scramble_free_queue()
    sender = KVSender(side.kv.buffers, side.specs, MODEL, config(path, **BIG_CFG), side.release)
    victim = Peer(run_decode, 17, BIG, path, BIG_CFG)
    try:
        ticket = sender.publish("orphan", side.allocate("orphan", 1024 * 16), 1024 * 16)
        assert victim.ask("pull", ticket) == "started"
        wait_until(lambda: sender.stats()["pulls_in_flight"] == 1)  # P serves the pull
        victim.kill()
        wait_until(lambda: side.released == ["orphan"], timeout=config().chunk_deadline_s + 10)
        d = KVSide(specs(**BIG), seed=18)
        receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, config(path, **BIG_CFG))
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
