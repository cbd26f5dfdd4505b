"""Scattered host pages as one UCX message listing them (transfer/ucp_iov.py, ``host_iov``):
no staging copy on either side once the link's endpoint has sent a rendezvous, byte-exact."""

from __future__ import annotations

import pytest
import torch

from tests.transfer.conftest import MODEL, KVSide, config, specs
from tests.transfer.test_runtime import in_fresh_process
from tests.transfer.test_transfer_local import wait_until
from transfer import KVReceiver, KVSender
from transfer.mapper import Fragment
from transfer.plan import Chunk
from transfer.runtime import RENDEZVOUS_PROOF_BYTES, rendezvous_bytes
from transfer.ucp_abi import completion_callbacks
from transfer.ucp_iov import chunk_pieces

pytestmark = pytest.mark.timeout(120)
BIG_PAGES = dict(page_size=16, heads=4, head_dim=64)  # 96 KiB pages


def test_pieces_follow_wire_order_and_merge_neighbours_on_their_own_side() -> None:
    rows = {"a": torch.zeros(8, 16, dtype=torch.uint8), "b": torch.zeros(8, 16, dtype=torch.uint8)}
    chunk = Chunk(
        0,
        (
            Fragment("a", "b", 32, 0, 16),
            Fragment("a", "b", 48, 64, 16),  # P: follows the one before; D: does not
            Fragment("a", "b", 0, 80, 16),  # D: follows the one before; P: does not
        ),
    )
    a, b = rows["a"].data_ptr(), rows["b"].data_ptr()
    assert chunk_pieces(chunk, rows, source=True) == [(a + 32, 32), (a, 16)]
    assert chunk_pieces(chunk, rows, source=False) == [(b, 16), (b + 64, 32)]


def test_rendezvous_size_follows_the_ucx_setting() -> None:
    assert rendezvous_bytes({}, {}) == RENDEZVOUS_PROOF_BYTES
    assert rendezvous_bytes({"UCX_RNDV_THRESH": "auto"}, {}) == RENDEZVOUS_PROOF_BYTES
    assert rendezvous_bytes({"UCX_RNDV_THRESH": "4m"}, {}) == (4 << 20) + 1
    assert rendezvous_bytes({}, {"UCX_RNDV_THRESH": "2M"}) == (2 << 20) + 1
    assert rendezvous_bytes({}, {"UCX_RNDV_THRESH": "1k"}) == RENDEZVOUS_PROOF_BYTES
    assert rendezvous_bytes({"UCX_RNDV_THRESH": "inf"}, {}) is None  # unreadable: never proven


def test_scattered_host_pages_move_without_staging_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides' pages scattered. D lists its pages for every chunk; P stages only until its
    endpoint has completed a rendezvous send (UCX cannot start with an IOV one), then lists
    them too; a second pull on the link copies nothing. The bytes arrive exact each time."""
    import transfer.peer
    import transfer.pull
    import transfer.serve

    calls: list[str] = []

    def counted(real, name: str):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(
        transfer.serve, "gather_chunk", counted(transfer.serve.gather_chunk, "gather")
    )
    monkeypatch.setattr(
        transfer.pull, "scatter_chunk", counted(transfer.pull.scatter_chunk, "scatter")
    )
    for name in ("send_pieces", "recv_pieces"):
        real = getattr(transfer.peer.PeerLink, name)
        monkeypatch.setattr(transfer.peer.PeerLink, name, counted(real, name))
    p, d = KVSide(specs(**BIG_PAGES), seed=3), KVSide(specs(**BIG_PAGES), seed=4)
    p.scramble_free_queue()
    d.scramble_free_queue()
    cfg = config(staging_tokens=64, staging_buffers=2, prestage=False)  # 4 pages: 384 KiB a chunk
    sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
    # (completions come by the C callbacks wherever they can be built)
    assert receiver.iov is not None
    assert receiver.iov.called_back == (completion_callbacks() is not None)
    try:
        for rid in ("first", "second"):
            calls.clear()
            src, dst = p.allocate(rid, 1024), d.allocate(rid, 1024)
            result = receiver.pull_blocking(sender.publish(rid, src, 1024), dst, 0, 1024)
            assert result.ok, result.error
            assert result.stats.chunks == 16
            assert torch.equal(d.pages_of(dst)["full"], p.pages_of(src)["full"])
            assert calls.count("scatter") == 0 and calls.count("recv_pieces") == 16
            gathers = calls.count("gather")
            assert gathers + calls.count("send_pieces") == 16
            if rid == "first":  # staged until the first staged send completed
                assert 1 <= gathers < 16, calls
            else:
                assert gathers == 0, calls
            wait_until(lambda rid=rid: rid in p.released)
            d.free(rid)
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_host_iov_off_stages_scattered_pages() -> None:
    p, d = KVSide(specs(), seed=5), KVSide(specs(), seed=6)
    p.scramble_free_queue()
    d.scramble_free_queue()
    cfg = config(host_iov=False)
    sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
    try:
        assert sender.iov is None and receiver.iov is None
        chunk = Chunk(
            0, (Fragment("full", "full", 0, 4096, 16), Fragment("full", "full", 64, 0, 16))
        )
        assert not receiver.moves_straight(chunk, source=False)
        assert not sender.moves_straight(chunk, source=True)
    finally:
        receiver.close()
        sender.close()


def test_without_c_callbacks_completions_are_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler (here: DUET_UCP_CALLBACKS=0): the loop polls UCP for completions, and the
    same scattered pull arrives byte-exact."""
    monkeypatch.setenv("DUET_UCP_CALLBACKS", "0")
    in_fresh_process(
        """
import torch
from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver, KVSender
p, d = KVSide(specs(page_size=16, heads=4, head_dim=64), seed=7), KVSide(specs(page_size=16, heads=4, head_dim=64), seed=8)
p.scramble_free_queue(); d.scramble_free_queue()
cfg = config(staging_tokens=64, prestage=False)
sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
assert receiver.iov is not None and not receiver.iov.called_back
for rid in ("a", "b"):
    src, dst = p.allocate(rid, 512), d.allocate(rid, 512)
    result = receiver.pull_blocking(sender.publish(rid, src, 512), dst, 0, 512)
    assert result.ok, result.error
    assert torch.equal(d.pages_of(dst)["full"], p.pages_of(src)["full"])
receiver.close(); sender.close()
print("ok")
"""
    )
